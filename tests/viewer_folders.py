"""Run and eval folders for the viewer's tests, written by the project's own writers.

`arithmetic_run(path)`: a run folder whose rollouts come from the real arithmetic
environment (calculator tool calls and outputs, rubric reward parts) played by a scripted
policy through the real `Orchestrator`, recorded by `RolloutLog`, with the metrics written by
`RunDir`; one recorded rollout also carries a SWE-style diff and hostile markup in a tool
output. `arithmetic_eval(path, right_every=...)`: an eval folder (`results.jsonl` +
`summary.json` in `agentrl.evaluate`'s layout) of the same environment's test tasks.
The training side is the loop's bookkeeping only; the e2e viewer tests use a real run.
`trained_run(path)`: the same loop with the real trainer on the tiny MoE (`LocalTrainer`) and
the policy's tokens folded into its vocabulary (`InVocabulary`), so each recorded rollout
carries the trainer's per-token logprobs of that step's forward pass.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

from agentrl.evaluation.engine import EvalConfig
from agentrl.evaluation.summary import summarize
from agentrl.hub.loader import load_environment
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.rl.orchestrator import Orchestrator, OrchestratorConfig
from agentrl.rl.report import RunDir
from agentrl.rl.rollout_log import RolloutLog
from agentrl.sampling import SamplingConfig

DIFF = ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n"
        " def add(a, b):\n-    return a - b\n+    return a + b\n")
HOSTILE = '<img src=x onerror="document.body.dataset.pwned=1"><script>document.body.dataset.pwned=1</script>'


def policy(right_every: int = 2) -> ScriptedPolicy:
    """Calls the calculator, then answers right on every `right_every`-th call, else wrong."""
    calls = itertools.count()

    def reply(messages, tools):
        if messages[-1].role == "tool":
            right = next(calls) % right_every == 0
            return f"<answer>{messages[-1].content if right else '-1'}</answer>"
        expression = messages[-1].content.split("Compute:", 1)[-1].strip()
        return {"content": "Let me compute.", "tool_calls": [tool_call("calculator", expression=expression)]}

    return ScriptedPolicy(reply, name=f"right-every-{right_every}")


class _Bookkeeping:
    """Takes the loop's samples and pushes; reports the metric keys the loop reads."""

    async def train_step(self, samples, *, step, logprobs_of=()):
        return {"mismatch_kl": 1e-4 * (step + 1), "loss": 0.0}

    async def save_checkpoint(self, path, *, step):
        pass

    async def push(self, *, version):
        return None


class _MarkedLog(RolloutLog):
    """The run's log, with a diff and hostile markup put into the first step's first rollout."""

    def record(self, step, groups, advantages, **kwargs):
        if step == 0:
            rollout = groups[0].rollouts[0]
            rollout.state["diff"] = DIFF
            next(m for m in rollout.messages if m.role == "tool").content += HOSTILE
        return super().record(step, groups, advantages, **kwargs)


def arithmetic_run(path: Path, *, steps: int = 3, samples_per_step: int = 6,
                   groups_per_step: int = 3) -> Path:
    run = RunDir(path).create('[env]\nname = "arithmetic"\n[model]\nname = "tiny-moe"\n'
                              f'[orchestrator]\nmax_steps = {steps}\n')
    log = _MarkedLog(path, samples_per_step=samples_per_step, max_bytes=2**26)

    bookkeeping = _Bookkeeping()
    orchestrator = Orchestrator(
        config=OrchestratorConfig(max_steps=steps, groups_per_step=groups_per_step, rollouts_per_group=4,
                                  max_off_policy_steps=0),
        environment=load_environment("arithmetic", num_train=24, num_test=8), client=policy(),
        trainer=bookkeeping, weight_sync=bookkeeping, sampling=SamplingConfig(), on_step=run.append_metrics,
        on_groups=log,
    )
    asyncio.run(orchestrator.run())
    return path


class InVocabulary:
    """A scripted policy with its byte-level token ids folded into the tiny MoE's 128 ids
    (element-wise, so each turn still extends the previous one)."""

    def __init__(self, policy: ScriptedPolicy, *, vocab: int = 128) -> None:
        self.policy, self.vocab, self.name = policy, vocab, policy.name

    async def chat(self, messages, **kwargs):
        message, turn = await self.policy.chat(messages, **kwargs)
        turn.prompt_token_ids = [token % self.vocab for token in turn.prompt_token_ids]
        turn.completion.token_ids = [token % self.vocab for token in turn.completion.token_ids]
        return message, turn


class LocalTrainer:
    """The real trainer in this process as the orchestrator's `PolicyTrainer` (the launcher drives it
    through Ray actors). It keeps, per asked sample (by its token ids), a separate forward taken with
    the weights before the step, for tests to compare with what the step returned."""

    def __init__(self, *, row_tokens: int = 1024) -> None:
        from agentrl.created_models import ensure_tiny_moe
        from agentrl.trainer.config import TrainerConfig
        from agentrl.trainer.trainer import Trainer

        self.trainer = Trainer(TrainerConfig(row_tokens=row_tokens, optimizer={"lr": 1e-2}),
                               model_dir=ensure_tiny_moe(), device="cpu")
        self.expected: dict[tuple[int, ...], list[float]] = {}

    def forward(self, token_ids: list[int]) -> list[float]:
        """Logprob of each token after the first, from one unpacked forward of the current weights."""
        import torch

        from agentrl.trainer.models.attention import build_segments

        ids = torch.tensor(token_ids)
        positions = torch.arange(len(ids) - 1)
        with torch.no_grad():
            return self.trainer.model(ids[:-1], positions, build_segments(positions),
                                      targets_T=ids[1:]).float().tolist()

    async def train_step(self, samples, *, step, logprobs_of=()):
        for index in logprobs_of:
            self.expected[tuple(samples[index].token_ids)] = self.forward(samples[index].token_ids)
        return self.trainer.train_on_samples(samples, logprobs_of=logprobs_of)

    async def save_checkpoint(self, path, *, step):
        pass

    async def push(self, *, version):
        return None


def trained_run(path: Path, *, steps: int = 2, samples_per_step: int = 3) -> tuple[Path, LocalTrainer]:
    """A run folder trained by the real trainer (see the module docstring) and that trainer."""
    run = RunDir(path).create('[env]\nname = "arithmetic"\n[model]\nname = "tiny-moe"\n'
                              f'[orchestrator]\nmax_steps = {steps}\n')
    trainer = LocalTrainer()
    orchestrator = Orchestrator(
        config=OrchestratorConfig(max_steps=steps, groups_per_step=2, rollouts_per_group=2, max_off_policy_steps=0),
        environment=load_environment("arithmetic", num_train=8, num_test=2), client=InVocabulary(policy()),
        trainer=trainer, weight_sync=trainer, sampling=SamplingConfig(), on_step=run.append_metrics,
        on_groups=RolloutLog(path, samples_per_step=samples_per_step, max_bytes=2**26),
    )
    asyncio.run(orchestrator.run())
    return path, trainer


def arithmetic_eval(path: Path, *, right_every: int, tasks: int = 4, rollouts_per_task: int = 2) -> Path:
    env = load_environment("arithmetic", num_train=24, num_test=8)
    client = policy(right_every)

    async def groups():
        return [await env.run_group(client, task, n=rollouts_per_task, sampling=SamplingConfig())
                for task in env.tasks("test", n=tasks, seed=0)]

    scored = asyncio.run(groups())
    path.mkdir(parents=True)
    with open(path / "results.jsonl", "w") as handle:
        for index, group in enumerate(scored):
            for member, rollout in enumerate(group):
                handle.write(json.dumps({"task_index": index, "rollout_index": member,
                                         **rollout.model_dump(mode="json")}) + "\n")
    config = EvalConfig(env="arithmetic", model=client.name, n=tasks, rollouts_per_task=rollouts_per_task)
    summary = summarize(scored, config=config, env_name="arithmetic", elapsed_s=1.0, client="scripted",
                        base_url="none")
    (path / "summary.json").write_text(summary.model_dump_json(indent=2))
    return path
