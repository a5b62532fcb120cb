"""The Ray actors of a run: rollout workers here, inference and trainer ranks beside it.

- `RolloutWorker`: the environment and a `TokenClient` to the run's inference endpoint (the
  router in front of several servers, else the server), running groups of rollouts. Each
  group runs in one trajectory session (`X-Session-ID`), so the router keeps its rollouts,
  which share a prompt, on one replica; a request that fails while a server restarts is
  retried until the endpoint answers again (`SupervisedClient` over an `EndpointWatch`; a P/D pair's
  prefill server is watched too).
- `agentrl.rl.inference_actor`: `InferenceActor` (a supervised vLLM server and its weight
  loads) and `InferenceNodeActor` (a node of a wide-EP or P/D plan).
- `agentrl.rl.trainer_rank`: `TrainerRank`, one rank of the trainer's process group.

Each imports torch, vLLM and the environment inside the actor process, never in the driver.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from agentrl.types import Rollout, Task

__all__ = ["RolloutWorker"]


class RolloutWorker:
    """Runs groups of rollouts of the environment against the run's inference endpoint."""

    def __init__(self, env_name: str, env_args: dict[str, Any], *, url: str, model: str, nice: int = 0,
                 recovery_timeout_s: float = 600.0, tokenizer_dir: str | None = None,
                 tokenizer_files: dict[str, bytes] | None = None, adapter: str | None = None,
                 prefill_url: str | None = None) -> None:
        """`model` is the served model name; prompts are rendered with the tokenizer of `tokenizer_dir` (the
        run's starting weights: what the servers serve), or with the files shipped from it when this node
        does not see it, else with `model`'s. `adapter`: the LoRA adapter the servers serve the policy as
        (`inference.lora_adapters`), named in every request. `prefill_url`: a P/D pair's prefill server, which
        every request visits first (`clients.prefill_decode`)."""
        from agentrl.clients.session import attach_session_affinity
        from agentrl.clients.token_client import TokenClient
        from agentrl.cpu_priority import lower_priority
        from agentrl.hub.loader import load_environment
        from agentrl.inference.supervisor import EndpointWatch, SupervisedClient

        # Every thread this worker has now; threads it starts later inherit the niceness.
        lower_priority(os.getpid(), nice=nice)

        self.environment = load_environment(env_name, **env_args)
        client = TokenClient(url, model=model, renderer=_renderer(tokenizer_dir, tokenizer_files),
                             served_model_name=adapter, prefill_url=prefill_url)
        attach_session_affinity(client.http)
        self.token_client = client
        watch = EndpointWatch(url, also=[prefill_url] if prefill_url else [])
        self.client = SupervisedClient(
            client,
            watch,
            max_retries=max(1, int(recovery_timeout_s / watch.health_interval_s)),
            recovery_timeout_s=recovery_timeout_s,
        )

    def node(self) -> str:
        return _node_id()

    def use_adapter(self, name: str, version: int) -> None:
        """Requests from now on name adapter `name`, their tokens of policy `version` (a shared server:
        `agentrl.inference.shared_server`)."""
        self.token_client.use_adapter(name, version)

    def retried(self) -> int:
        """Requests retried because a server was down (a restart behind the endpoint)."""
        return self.client.retried

    async def run_group(self, task: Task, n: int, sampling: Any) -> list[Rollout]:
        from agentrl.clients.session import trajectory_session

        with trajectory_session(uuid.uuid4().hex):  # the group's rollouts share its prompt: one replica
            return await self.environment.run_group(self.client, task, n=n, sampling=sampling)

    async def close(self) -> None:
        """Release what the environment holds between rollouts (a sandboxed environment's warm pool)."""
        closing = getattr(self.environment, "aclose", None)
        if closing is not None:
            await closing()


def _renderer(tokenizer_dir: str | None, files: dict[str, bytes] | None) -> Any:
    """The chat renderer of `tokenizer_dir`: read there when this node sees it, else from the shipped `files`."""
    if tokenizer_dir is None:
        return None
    import shutil
    import tempfile
    from pathlib import Path

    from agentrl.chat import ChatRenderer
    from agentrl.rl.shipping import node_dir, write_folder

    if (Path(tokenizer_dir) / "config.json").is_file() or files is None:
        return ChatRenderer.from_pretrained(tokenizer_dir)
    scratch = Path(tempfile.mkdtemp(prefix="tokenizer-", dir=node_dir("tmp")))
    try:  # the tokenizer lives in memory once loaded: the copy goes at once
        return ChatRenderer.from_pretrained(write_folder(files, scratch / "model"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
