"""Evaluate a model on an environment: `agentrl.evaluate(...)` and the engine of `agentrl eval`.

Draws `n` tasks from a split, runs `rollouts_per_task` rollouts of each (one group per
task, scored together by the environment's rubric) with bounded concurrency, and returns
an `EvalSummary` (`agentrl.evaluation.summary`): mean reward, avg@k, pass@k (the unbiased
estimator of Chen et al. 2021, a rollout passes when its reward reaches `pass_threshold`),
per-metric means, token counts and throughput. Each finished rollout is appended to
`results.jsonl` as soon as its group is scored (tokens and logprobs included; routed experts
left out: a server started for training returns them for every token, 160 kB of JSON per
rollout of a 46-layer model, which the evaluation never reads); `summary.json` is written at
the end.

Without `base_url` a vLLM server for the model is started (and stopped) here and the
token client is used; with `base_url` the token client is used when the server offers
`/inference/v1/generate` and the model's tokenizer is available locally, else the OpenAI
chat-completions client.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import Field

from agentrl.clients.openai_client import OpenAIClient
from agentrl.config import BaseConfig
from agentrl.environment import Environment
from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.evaluation.compare import Comparison, run_baseline
from agentrl.evaluation.summary import EvalSummary, pass_at_k, summarize
from agentrl.hub.loader import check_environment_args, load_environment
from agentrl.models import resolve_model
from agentrl.sampling import SamplingConfig
from agentrl.types import Rollout

__all__ = ["EvalConfig", "EvalSummary", "check_evaluation", "compare_checkpoint", "default_output_dir", "evaluate",
           "evaluate_async", "pass_at_k"]


class EvalConfig(BaseConfig):
    """What `agentrl eval` runs."""

    env: str = "reverse-text"
    """Environment name or package folder."""
    model: str = "tiny-moe"
    """Model preset, local HF folder or HF repo id (the served model name with --base-url)."""
    n: int = Field(default=64, ge=1)
    """Number of tasks drawn from the split."""
    rollouts_per_task: int = Field(default=4, ge=1)
    """Rollouts per task (k of avg@k and pass@k)."""
    split: str = "test"
    """Dataset split the tasks come from."""
    seed: int = 0
    """Seed for drawing tasks."""
    max_concurrent: int = Field(default=128, ge=1)
    """Most rollouts in flight at once."""
    base_url: str | None = None
    """An already running server; when unset a vLLM server is started for the run."""
    api_key: str | None = None
    """API key for --base-url (OpenAI client); OPENAI_API_KEY is used when unset."""
    client: Literal["auto", "token", "openai"] = "auto"
    """Client kind: token-in/token-out (vLLM), OpenAI chat completions, or chosen automatically."""
    pass_threshold: float = 1.0
    """A rollout passes (for pass@k) when its reward is at least this."""
    output: Path | None = None
    """Results folder; default runs/eval-<env>-<model>-<timestamp>/."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings of every model call."""
    env_args: dict[str, Any] = {}
    """Keyword arguments for the environment's load_environment."""
    oracle: bool = False
    """Play the environment package's own oracle (`oracle_policy()` in its module: its reference solutions) instead
    of a model, with no server: every task should score 1 (`agentrl.evaluation.oracle`)."""


def _slug(text: str) -> str:
    text = Path(text).name if ("/" in text and Path(text).exists()) else text
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "model"


def default_output_dir(env: str, model: str) -> Path:
    """runs/eval-<env>-<model>-<UTC timestamp>/ under the current folder."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"eval-{_slug(env)}-{_slug(model)}-{stamp}"


async def _check_reachable(base_url: str) -> None:
    """Fail at once, in one line, when no server answers at `base_url` (any HTTP answer will do),
    instead of running every rollout into the same connection error."""
    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            await http.get(base_url)
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise AgentrlError(
            f"base_url {base_url!r}: no server answers ({type(error).__name__}: {error}); start one"
            " (`agentrl serve`) or fix the URL"
        ) from None


async def _has_token_endpoint(base_url: str) -> bool:
    """True when the server routes /inference/v1/generate (an empty body gets 422, not 404)."""
    try:
        async with httpx.AsyncClient(timeout=10.0) as http:
            response = await http.post(f"{base_url.rstrip('/').removesuffix('/v1')}/inference/v1/generate", json={})
    except httpx.HTTPError:
        return False
    return response.status_code in (400, 422)


async def _make_client(config: EvalConfig, base_url: str, *, started_here: bool):
    from agentrl.clients.token_client import TokenClient

    kind = config.client
    spec = None
    if kind in ("auto", "token"):
        try:
            spec = resolve_model(config.model)
        except AgentrlError:
            if kind == "token":
                raise
        if kind == "auto":
            kind = "token" if spec is not None and (started_here or await _has_token_endpoint(base_url)) else "openai"
    connections = max(8, config.max_concurrent)
    if kind == "token":
        # The generate endpoint needs no model name: the server's one model answers.
        client = TokenClient(base_url, model=config.model, max_connections=connections, api_key=config.api_key)
        await asyncio.to_thread(lambda: client.renderer)  # load the tokenizer before the clock starts
        return "token", client
    name = spec.name if spec else config.model
    return "openai", OpenAIClient(
        base_url, model=await _served_name(base_url, name, api_key=config.api_key), api_key=config.api_key,
        max_connections=connections,
    )


async def _served_name(base_url: str, wanted: str, *, api_key: str | None) -> str:
    """`wanted` if the server lists it (or lists nothing); else the server's only model."""
    base = base_url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10.0, headers=headers) as http:
            response = await http.get(f"{base}/models")
        served = [entry["id"] for entry in response.json().get("data", [])] if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        served = []
    if not served or wanted in served:
        return wanted
    if len(served) == 1:
        return served[0]
    raise AgentrlError(f"{base_url} does not serve model {wanted!r}; it serves: {', '.join(served)}")


def result_record(task_index: int, rollout_index: int, rollout: Rollout) -> dict[str, Any]:
    """The `results.jsonl` line of one rollout: its indices and `Rollout.record` (no routed experts)."""
    return {"task_index": task_index, "rollout_index": rollout_index, **rollout.record()}


def _slot_scheduled_group(env: Any, client: Any, config: EvalConfig) -> Callable[[Any], Any]:
    """`task -> scored group`, keeping at most `max_concurrent` rollouts in flight.

    Slots are per rollout, not per group, so a group waiting for its slowest member does not
    hold idle slots. This is `Environment.run_group` (same seeds: seed + i for member i) with
    the rollouts scheduled one by one; an environment that overrides `run_group` keeps its
    own, with whole groups scheduled instead.
    """
    rollout_slots = asyncio.Semaphore(config.max_concurrent)
    size = config.rollouts_per_task
    if type(env).run_group is not Environment.run_group:
        group_slots = asyncio.Semaphore(max(1, config.max_concurrent // size))

        async def whole_group(task: Any) -> list[Rollout]:
            async with group_slots:
                return await env.run_group(client, task, n=size, sampling=config.sampling)

        return whole_group

    def sampling_for(member: int) -> SamplingConfig:
        if config.sampling.seed is None:
            return config.sampling
        return config.sampling.model_copy(update={"seed": config.sampling.seed + member})

    async def one(task: Any, member: int) -> Rollout:
        async with rollout_slots:
            return await env.rollout(client, task, sampling=sampling_for(member))

    async def group(task: Any) -> list[Rollout]:
        rollouts = await asyncio.gather(*(one(task, member) for member in range(size)))
        return await env.score(list(rollouts))

    return group


async def evaluate_async(
    config: EvalConfig, *, environment: Any = None, on_group: Callable[[list[Rollout]], None] | None = None,
    on_start: Callable[[int], None] | None = None, server_startup_s: float | None = None,
) -> EvalSummary:
    """Run an evaluation against `config.base_url` (a running server), or of the environment's oracle
    (`config.oracle`), and return its summary."""
    config = _oracle_checked(config)
    if config.base_url is None and not config.oracle:
        raise AgentrlError("evaluate_async needs base_url; agentrl.evaluate() starts a server when it is unset")
    env = environment if environment is not None else load_environment(config.env, **config.env_args)
    tasks = env.tasks(config.split, n=config.n, seed=config.seed)
    if not tasks:
        raise AgentrlError(f"environment {env.name!r}: split {config.split!r} has no tasks")
    if len(tasks) < config.n and "n" in config.model_fields_set:  # asked for, not the default 64
        import warnings

        from agentrl.errors import AgentrlWarning

        warnings.warn(f"n = {config.n} tasks asked, but split {config.split!r} of {env.name!r} has {len(tasks)}: "
                      f"evaluating {len(tasks)}", AgentrlWarning, stacklevel=2)
    output = Path(config.output) if config.output else default_output_dir(env.name, config.model)
    results_file = output / "results.jsonl"
    check_output_dir(output)
    oracle = None
    if config.oracle:
        from agentrl.evaluation.oracle import load_oracle

        oracle = load_oracle(env, config.env_args)  # a package without one fails here, before anything is written
    elif server_startup_s is None:
        await _check_reachable(config.base_url)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"output {output}: cannot create the folder ({error.strerror}); give a writable folder "
                          "with -o") from None

    if oracle is not None:
        kind, client = "oracle", oracle
    else:
        kind, client = await _make_client(config, config.base_url, started_here=server_startup_s is not None)
    if on_start is not None:
        on_start(len(tasks) * config.rollouts_per_task)
    groups: list[list[Rollout] | None] = [None] * len(tasks)
    started = time.monotonic()
    run_group = _slot_scheduled_group(env, client, config)

    async def run(index: int) -> None:
        group = await run_group(tasks[index])
        groups[index] = group
        lines = "".join(
            json.dumps(result_record(index, member, rollout)) + "\n" for member, rollout in enumerate(group)
        )
        try:
            with open(results_file, "a") as handle:
                handle.write(lines)
        except OSError as error:  # a full disk: stop; the groups written so far stay
            raise AgentrlError(f"{results_file}: cannot write results ({error.strerror}); the evaluation stopped, "
                               "the results written before are kept") from None
        if on_group is not None:
            on_group(group)

    try:
        async with asyncio.TaskGroup() as task_group:  # one failure cancels the rest
            for index in range(len(tasks)):
                task_group.create_task(run(index))
    except BaseExceptionGroup as failures:  # show the first failure itself (one line when it is ours)
        raise failures.exceptions[0] from None
    finally:
        if hasattr(client, "aclose"):  # an oracle policy holds no connection
            await client.aclose()
    elapsed = time.monotonic() - started
    summary = summarize(
        [g for g in groups if g is not None], config=config, env_name=env.name, elapsed_s=elapsed,
        client=kind, base_url=config.base_url or "",
    )
    summary.server_startup_s = server_startup_s
    summary.output_dir = str(output)
    try:
        (output / "summary.json").write_text(summary.model_dump_json(indent=2) + "\n")
    except OSError as error:
        raise AgentrlError(f"{output / 'summary.json'}: cannot write the summary ({error.strerror}); "
                           f"{results_file} holds every result") from None
    return summary


def _oracle_checked(config: EvalConfig) -> EvalConfig:
    """With `oracle`, no model and no server: the results are the oracle's (`model` reads "oracle")."""
    if not config.oracle:
        return config
    for key in ("model", "base_url"):
        if key in config.model_fields_set and getattr(config, key) not in (None, "oracle"):
            raise ConfigError(f"oracle (--oracle): the environment's own oracle plays, so {key} "
                              f"(--{key.replace('_', '-')}) = {getattr(config, key)!r} has no use; drop one of them")
    return config.model_copy(update={"model": "oracle"})


def check_output_dir(output: Path) -> None:
    """One-line errors, before any start-up, for an output that cannot be a results folder: a file, a path through
    a file, an existing results.jsonl, or a place this process cannot write (nothing is created here)."""
    results_file = output / "results.jsonl"
    probe = output
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"output {output}: {probe} is a file, not a folder; give a folder with -o")
    if results_file.exists() and results_file.stat().st_size > 0:
        raise AgentrlError(f"{results_file} already exists; choose another --output so earlier results are kept")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"output {output}: {probe} is not writable (read-only, or not this user's); give a "
                          "writable folder with -o")


def evaluate(
    env: Any = "reverse-text",
    *,
    model: str = "tiny-moe",
    n: int = 64,
    rollouts_per_task: int = 4,
    base_url: str | None = None,
    sampling: SamplingConfig | dict[str, Any] | None = None,
    output: str | Path | None = None,
    progress: bool = False,
    server_log: Path | None = None,
    checkpoint: str | Path | None = None,
    baseline: str | None = None,
    **options: Any,
) -> EvalSummary:
    """Evaluate `model` on `env` (a name, a folder or an Environment); see `EvalConfig` for options.

    Starts a vLLM server for the model unless `base_url` is given, and stops it afterwards.
    With `checkpoint` (a `RUN/checkpoints/step_N` folder of `agentrl train`), evaluates it
    and `baseline` (default: the model its run started from) on the same tasks and returns
    an `agentrl.evaluation.compare.Comparison` of the two (see `agentrl.evaluation.compare`).
    """
    if checkpoint is not None:
        return compare_checkpoint(env, checkpoint=checkpoint, baseline=baseline, n=n,
                                  rollouts_per_task=rollouts_per_task, sampling=sampling, output=output,
                                  progress=progress, **options)
    environment = None
    env_name = env
    if not isinstance(env, (str, Path)):
        environment, env_name = env, getattr(env, "name", "environment")
    if isinstance(sampling, dict):
        sampling = SamplingConfig(**sampling)
    config = EvalConfig(
        env=str(env_name), model=str(model), n=n, rollouts_per_task=rollouts_per_task, base_url=base_url,
        sampling=sampling or SamplingConfig(), output=Path(output) if output else None, **options,
    )
    return run_evaluation(config, environment=environment, progress=progress, server_log=server_log)


def compare_checkpoint(
    env: Any = "reverse-text", *, checkpoint: str | Path, baseline: str | None = None, **options: Any
) -> Comparison:
    """Evaluate `checkpoint` and `baseline` (default: what its run started from) with the same settings."""
    folder = Path(checkpoint).expanduser()
    if not (folder / "config.json").is_file():
        raise NotFoundError(f"checkpoint {checkpoint}: no config.json there; pass RUN/checkpoints/step_N")
    baseline = baseline or run_baseline(folder)
    if baseline is None:
        raise NotFoundError(f"checkpoint {checkpoint}: not inside a run folder; pass baseline=... (a model or folder)")
    output = options.pop("output", None)
    results = {}
    for role, model in (("checkpoint", str(folder)), ("baseline", baseline)):
        role_output = Path(output) / role if output else None
        results[role] = evaluate(env, model=model, output=role_output, **options)
    return Comparison(checkpoint=results["checkpoint"], baseline=results["baseline"])


def check_evaluation(config: EvalConfig) -> EvalConfig:
    """What `run_evaluation` refuses before any start-up, without building the environment or starting a server
    (`agentrl eval --dry-run`): the environment's name and arguments, the oracle, the output folder, the model."""
    config = _oracle_checked(config)
    check_environment_args(config.env, config.env_args)
    if config.output:
        check_output_dir(Path(config.output))
    if config.base_url is None and not config.oracle:
        resolve_model(config.model)
    return config


def run_evaluation(
    config: EvalConfig, *, environment: Any = None, progress: bool = False, server_log: Path | None = None,
    on_server: Callable[[Any], None] | None = None,
) -> EvalSummary:
    """Validate names, start a server when needed, run the evaluation, stop the server."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise AgentrlError(
            "agentrl.evaluate() blocks and cannot run inside an event loop; "
            "use `await agentrl.evaluation.engine.evaluate_async(EvalConfig(..., base_url=...))` there"
        )
    config = _oracle_checked(config)
    if environment is None:
        environment = load_environment(config.env, **config.env_args)  # unknown names fail before any server
    from agentrl.hub.sandbox_check import check_sandboxes

    check_sandboxes(environment)  # so do missing sandbox images, with the command that builds them
    output = Path(config.output) if config.output else default_output_dir(environment.name, config.model)
    check_output_dir(output)
    config = config.model_copy(update={"output": output})  # one folder for the results and the server's log
    server = None
    if config.base_url is None and not config.oracle:  # the oracle plays with no server
        resolve_model(config.model)  # unknown models fail with the list of presets
        from agentrl.inference.server import VLLMServer

        server = VLLMServer(config.model, log_path=server_log or output / "vllm.log")  # beside the results
        if on_server is not None:
            on_server(server)
        server.start()
        config = config.model_copy(update={"base_url": server.url})
    try:
        return asyncio.run(_with_progress(config, environment, progress, server.startup_s if server else None))
    finally:
        if server is not None:
            server.stop()


async def _with_progress(config: EvalConfig, environment: Any, progress: bool, startup_s: float | None):
    if not progress:
        return await evaluate_async(config, environment=environment, server_startup_s=startup_s)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("[bold]rollouts"), BarColumn(), MofNCompleteColumn(), TextColumn("reward {task.fields[reward]:.3f}"),
        TimeElapsedColumn(), TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task_id = bar.add_task("rollouts", total=None, reward=0.0)
        totals = {"reward": 0.0, "count": 0}

        def on_start(total: int) -> None:
            bar.update(task_id, total=total)

        def on_group(group: list[Rollout]) -> None:
            totals["reward"] += sum(r.reward for r in group)
            totals["count"] += len(group)
            bar.update(task_id, advance=len(group), reward=totals["reward"] / totals["count"])

        return await evaluate_async(
            config, environment=environment, on_group=on_group, on_start=on_start, server_startup_s=startup_s,
        )
