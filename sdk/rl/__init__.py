"""agentrl.rl: the RL loop around one optimizer step, its modules by role.

The loop (torch-free, tested with a tabular learner):
- `orchestrator.py` / `orchestrator_types.py`: the asynchronous loop (rollouts, staleness bound, trainer steps,
  weight pushes), its config, protocols and records; `advantages.py`: group advantages;
- `diagnostics.py`: one-line diagnoses (a failed run, Router Replay coverage); `heldout.py`: held-out evals;
- `rollout_stats.py`: a step's rollout figures (tool calls, parse failures, the time split, rubric means).

The run's config and plan:
- `config.py`: `RunConfig`, the root config of `agentrl train`, composing the component configs;
- `plan.py`: what a run needs (GPU defaults, trainer layout, inference plan, GPUs) and `--dry-run`;
- `step_time.py` / `decode_model.py`: the predicted step time and the decode speed it is built on;
- `shared_gpu.py`: the memory plan of a GPU a trainer rank and a vLLM server share.

The Ray runtime:
- `launch.py`: `run_training`, which places the actors and drives the orchestrator;
- `placement.py`: placement groups per role and node; `actors.py`: rollout workers;
- `groups.py`: the trainer ranks as one trainer, the servers as one endpoint; `shared_server.py`: a server
  other runs share (`inference.base_url`) in its place;
- `trainer_rank.py` / `inference_actor.py`: one trainer rank, one supervised vLLM server;
- `transport.py`: `WeightPush`, the weights to every server after each step (`agentrl.inference.transfer`);
- `shipping.py`: folders between nodes without a shared filesystem; `stopping.py`: signals.

The run folder:
- `report.py`: config, metrics, plots, report; `resume.py`: checkpoints and `--resume`;
- `rollout_log.py`: the sampled rollouts; `loggers.py`: TensorBoard and W&B;
- `sft.py`: the supervised warm start (`agentrl sft`).
- `pretrain.py`: next-token pretraining on raw text with the routing figures (`agentrl pretrain`).

Everything here imports without torch, vllm or ray; the launcher reaches `agentrl.trainer`,
`agentrl.inference` and Ray inside the functions that start them.
"""
