"""agentrl.rl: the RL loop around one optimizer step.

- `config.py`: `RunConfig`, the root config of `agentrl train`, composing the component configs;
- `orchestrator.py`: the asynchronous loop (rollouts, staleness bound, trainer steps, weight pushes);
- `orchestrator_types.py` / `diagnostics.py`: its config, protocols and records; its one-line
  diagnoses (a failed run, Router Replay coverage);
- `plan.py`: what a run needs (trainer layout, inference plan, GPUs) and `--dry-run`;
- `actors.py`: the Ray actors (inference servers, trainer ranks, rollout workers);
- `launch.py`: `run_training`, which places the actors and drives the orchestrator;
- `resume.py` / `report.py`: checkpoints of a run and its folder (metrics, plots, report);
- `sft.py`: the supervised warm start (`agentrl sft`).

Everything here imports without torch, vllm or ray; the launcher reaches `agentrl.trainer`,
`agentrl.inference` and Ray inside the functions that start them.
"""
