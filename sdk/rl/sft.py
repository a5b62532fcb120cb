"""`agentrl sft`: supervised warm start of a policy on an environment's demonstrations.

A tiny random policy cannot learn from RL alone (its reward has no variance to follow),
so the embedded default starts from a short supervised run. Demonstrations come from the
environment itself: each task's episode is played by a teacher that answers with the
environment package's `oracle_policy()` (or, without one, the task's `answer`), through
the environment's own `rollout` (its tools, sandboxes included, run for real; at most
`max_concurrent_episodes` at once), so the prompt tokens are exactly those RL will see. The
model's tokenizer and chat template render them (`TeacherClient`: a reply with tool calls is
written as the template writes it, and parsed back as a model's completion is), the
assistant tokens become the loss mask, and the trainer runs in its cross-entropy mode
(`trainer.loss.mode = "sft"`). The result is exported as a Hugging Face folder that
`model.init_checkpoint` (and vLLM) can load.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from agentrl.config import BaseConfig, over_defaults
from agentrl.errors import AgentrlError
from agentrl.sampling import SamplingConfig
from agentrl.trainer.config import TrainerConfig
from agentrl.types import Completion, Message, Task, TrainingSample, Turn

__all__ = ["SFTConfig", "TeacherClient", "demonstrations", "run_sft"]


_SFT_TRAINER: dict[str, Any] = {"loss": {"mode": "sft"}, "optimizer": {"lr": 3e-3},
                                "row_tokens": 2048, "parallel": {"activation_checkpointing": False}}
"""The trainer defaults of this role; a [trainer] table given is laid over them."""


class SFTConfig(BaseConfig):
    """A supervised warm-start run."""

    env: str = "reverse-text"
    """Environment whose demonstrations are learned."""
    env_args: dict[str, Any] = {}
    """Keyword arguments of the environment's load_environment."""
    oracle_args: dict[str, Any] = {}
    """Keyword arguments of the environment's oracle_policy (key-hunt: guess_rate, seed)."""
    model: str = "tiny-moe"
    """Model preset or HF folder to start from."""
    split: str = "train"
    """Split the demonstrations come from."""
    steps: int = Field(default=300, ge=1)
    """Optimizer steps."""
    batch_size: int = Field(default=64, ge=1)
    """Demonstrations per step."""
    seed: int = 0
    """Seed of the demonstration order."""
    output: str = "cookbook/cpu-default/tiny-moe-sft"
    """Folder the HF export is written to."""
    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig.model_validate(_SFT_TRAINER))
    """Trainer settings (loss.mode must be 'sft')."""
    _trainer_defaults = field_validator("trainer", mode="before")(over_defaults(_SFT_TRAINER))
    export_every: int = Field(default=0, ge=0)
    """Also export (overwriting `output`) every this many steps, so long runs leave usable weights (0: only at end)."""
    torch_threads: int = Field(default=1, ge=0)
    """CPU threads torch may use (0: torch's default; 1 avoids oversubscribing a small shared CPU)."""
    max_concurrent_episodes: int = Field(default=16, ge=1)
    """Demonstration episodes played at once (each holds its sandbox in sandboxed environments)."""


Reply = Callable[[list[Message], "list[dict[str, Any]] | None"], "Message | str"]


class TeacherClient:
    """A ChatClient that answers with a teacher's reply, tokenized by the model's own template.

    A text reply is the completion as it is; a Message reply (with tool calls) becomes the text the
    chat template writes for it, parsed back into content and tool calls as a model's completion is."""

    def __init__(self, reply: Reply, *, renderer: Any, tokens: Any = None) -> None:
        from agentrl.clients.token_client import TokenClient

        self.reply = reply
        # Only the token client's prompt rendering (with multi-turn extension) is used; no request is sent.
        self._tokens = tokens or TokenClient("http://127.0.0.1:9", renderer=renderer)
        self.renderer = renderer

    async def chat(self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None,
                   sampling: SamplingConfig, previous: Turn | None = None) -> tuple[Message, Turn]:
        from agentrl.chat import assistant_message

        prompt_ids = self._tokens.prompt_ids(messages, tools=tools, previous=previous)
        reply = self.reply(messages, tools)
        text = reply if isinstance(reply, str) else self.renderer.assistant_text(messages, reply, tools=tools)
        ids = self.renderer.encode(text + self.renderer.assistant_closing().rstrip("\n"))
        completion = Completion(text=text, token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")
        return assistant_message(text, parse_tools=bool(tools)), Turn(prompt_token_ids=prompt_ids,
                                                                     completion=completion)

    async def aclose(self) -> None:
        await self._tokens.aclose()


def _oracle(env_name: str, **oracle_args: Any) -> Reply | None:
    """The environment package's oracle_policy(), as a reply function (text, or a Message with tool calls)."""
    from agentrl.hub.entrypoint import import_package_attr
    from agentrl.hub.loader import find_environment
    from agentrl.hub.manifest import load_manifest
    from agentrl.policies import as_message

    try:
        folder = find_environment(env_name)
        manifest = load_manifest(Path(folder) / "environment.toml")
        module = manifest.entrypoint.split(":")[0]
        factory = import_package_attr(folder, f"{module}:oracle_policy")
    except (AgentrlError, AttributeError, ImportError):
        return None
    try:
        policy = factory(**oracle_args)
    except TypeError as error:
        raise AgentrlError(f"sft: oracle_args {oracle_args}: {env_name}'s oracle_policy does not take them "
                           f"({error})") from None
    script = getattr(policy, "script", None)
    if not callable(script):
        return None

    def reply(messages: list[Message], tools: list[dict[str, Any]] | None) -> Message | str:
        answer = script(messages, tools)
        if isinstance(answer, str):
            return answer
        message = as_message(answer)
        return message if message.tool_calls else message.content

    return reply


def demonstrations(environment: Any, tasks: list[Task], *, renderer: Any, oracle: Reply | None,
                   max_concurrent: int = 16) -> list[TrainingSample]:
    """Play each task with the teacher through the environment's rollout (at most `max_concurrent` at once);
    return the token samples."""
    sampling = SamplingConfig(max_tokens=4096)

    async def run() -> list[TrainingSample | None]:
        shared = TeacherClient(lambda messages, tools: "", renderer=renderer)
        slots = asyncio.Semaphore(max_concurrent)

        async def one(task: Task) -> TrainingSample | None:
            reply = oracle or (lambda messages, tools, answer=task.answer: answer)
            client = TeacherClient(reply, renderer=renderer, tokens=shared._tokens)
            async with slots:
                rollout = await environment.rollout(client, task, sampling=sampling)
            if rollout.error or not rollout.turns:
                return None
            return rollout.sample()

        try:
            return list(await asyncio.gather(*(one(task) for task in tasks)))
        finally:
            closing = getattr(environment, "aclose", None)
            if closing is not None:
                await closing()  # a sandboxed environment's warm pool
            await shared.aclose()

    samples = [s for s in asyncio.run(run()) if s is not None]
    if not samples:
        raise AgentrlError("sft: no demonstration could be played; does the environment have answers or an oracle?")
    return samples


def run_sft(config: SFTConfig, *, on_step: Callable[[dict[str, float]], None] | None = None) -> Path:
    """Train the model on demonstrations for `config.steps` steps and export it to `config.output`."""
    if config.trainer.loss.mode != "sft":
        raise AgentrlError("sft: trainer.loss.mode must be 'sft'")
    from agentrl.chat import ChatRenderer
    from agentrl.hub.loader import load_environment
    from agentrl.models import ensure_model
    from agentrl.trainer.trainer import Trainer

    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    model_dir = Path(ensure_model(config.model))
    environment = load_environment(config.env, **config.env_args)
    renderer = ChatRenderer.from_pretrained(model_dir)
    tasks = environment.tasks(config.split, seed=config.seed)
    oracle = _oracle(config.env, **config.oracle_args)
    if oracle is None and config.oracle_args:
        raise AgentrlError(f"sft: oracle_args are set but {config.env} has no oracle_policy to take them")
    samples = demonstrations(environment, tasks, renderer=renderer, oracle=oracle,
                             max_concurrent=config.max_concurrent_episodes)
    trainer_config = config.trainer.model_copy(update={"model": str(model_dir)})
    trainer = Trainer(trainer_config, model_dir=model_dir)
    rng = random.Random(config.seed)
    order: list[int] = []
    started = time.monotonic()
    history = []
    for step in range(config.steps):
        if len(order) < config.batch_size:
            more = list(range(len(samples)))
            rng.shuffle(more)
            order += more
        batch = [samples[i] for i in order[: config.batch_size]]
        del order[: config.batch_size]
        metrics = trainer.train_on_samples(batch)
        metrics["step"] = step
        metrics["elapsed_s"] = time.monotonic() - started
        history.append(metrics)
        if on_step is not None:
            on_step(metrics)
        if config.export_every and (step + 1) % config.export_every == 0 and step + 1 < config.steps:
            _export(trainer, config, history, len(samples))
    return _export(trainer, config, history, len(samples))


def _export(trainer: Any, config: SFTConfig, history: list[dict[str, float]], demonstrations: int) -> Path:
    output = Path(config.output)
    trainer.export_hf(output, dtype=None)
    (output / "agentrl_sft.json").write_text(json.dumps({
        "env": config.env, "model": config.model, "steps_done": len(history), "steps": config.steps,
        "batch_size": config.batch_size, "seed": config.seed, "demonstrations": demonstrations,
        "final_nll": history[-1].get("nll"), "lr": config.trainer.optimizer.lr,
    }, indent=2))
    return output
