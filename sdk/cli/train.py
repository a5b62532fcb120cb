"""`agentrl train` (asynchronous RL on Ray) and `agentrl sft` (supervised warm start).

Kept light at import: the run config, Ray, torch and the trainer load inside the commands.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer


def _run_name(env: str, model: str) -> str:
    def slug(text: str) -> str:
        return "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(text).name)[:40]

    return f"{slug(env)}-{slug(model)}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


def _step_line(metrics: dict, *, total: int, eta_s: float | None) -> str:
    """One step in at most 80 columns: step/total, reward, mismatch KL, R3 coverage, staleness, step time, bound
    (T trainer / I inference), ETA."""
    staleness = ",".join(f"{k}:{v}" for k, v in (metrics.get("staleness") or {}).items())
    kl = metrics.get("mismatch_kl")
    replayed = metrics.get("r3/replayed_fraction")  # present while samples carry routed experts (R3)
    eta = "" if eta_s is None else f" eta {int(eta_s) // 60}:{int(eta_s) % 60:02d}"
    if metrics.get("samples") == 0:  # a failed step: nothing trained, so no KL (not a NaN that reads as divergence)
        errors, ungraded = int(metrics.get("rollout_errors") or 0), int(metrics.get("grader_errors") or 0)
        trained = (f"not trained ({errors} rollouts failed)" if errors else
                   f"not trained ({ungraded} got no grade)" if ungraded else "not trained (no usable rollout)")
    else:
        trained = "kl " + ("n/a" if kl is None or kl != kl else f"{kl:.1e}")
    return (f"{metrics['step'] + 1:>4}/{total} reward {metrics['reward']:.4f} {trained}"
            + ("" if replayed is None else f" r3 {replayed:.2f}")
            + f" stale {staleness or '-'} {metrics.get('step_time_s', 0):.1f}s "
            + ("T" if metrics.get("bound") == "trainer" else "I") + eta)


_STEP_LINE = re.compile(r"^ *(\d+)/\d+ reward ", flags=re.MULTILINE)


def printed_steps(output: str) -> list[int]:
    """The steps (0-based, as in metrics.jsonl) whose `_step_line` is in `output`, in order: tests and tools read
    a run's console log through this, not through their own copy of the line's format."""
    return [int(number) - 1 for number in _STEP_LINE.findall(output)]


def _eval_line(metrics: dict) -> str | None:
    """The held-out evaluation that finished at this step (`agentrl.rl.heldout`), or None."""
    if "eval/mean_reward" not in metrics:
        return None
    avg = next((key for key in metrics if key.startswith("eval/avg@")), None)
    passes = " ".join(f"{key.removeprefix('eval/')} {metrics[key]:.2f}" for key in sorted(metrics)
                      if key.startswith("eval/pass@"))
    return (f"  held-out after step {metrics['eval/step'] + 1}: {avg.removeprefix('eval/')} {metrics[avg]:.3f} "
            f"[{metrics['eval/mean_reward_low']:.3f}-{metrics['eval/mean_reward_high']:.3f}] {passes} "
            f"({metrics['eval/tasks']} tasks)")


NO_SIGNAL_STEPS = 5
"""Steps in a row whose every group's rollouts got one reward before the run says it learns nothing."""


def _no_signal_line(metrics: dict, state: list) -> str | None:
    """Once, after `NO_SIGNAL_STEPS` steps in a row where every group's rollouts got the same reward (advantages
    of 0: a model that never solves a task, or always does), a note saying the run learns nothing."""
    flat = metrics.get("groups_without_signal")
    state[0] = state[0] + 1 if flat is not None and metrics.get("samples") and flat >= metrics["groups"] else 0
    if state[0] < NO_SIGNAL_STEPS or state[1]:
        return None
    state[1] = True
    return (f"  note: no learning signal for {NO_SIGNAL_STEPS} steps (each group: one reward for all, now "
            f"{metrics['reward']:.2f}); see agentrl sft for a warm start")  # within 120 columns, as every line


def _error_line(metrics: dict) -> str | None:
    """The step's failed rollouts and the first one's error (sandbox or model text, through `printable`), or None."""
    if not metrics.get("rollout_errors"):
        return None
    from agentrl.cli import printable

    first_error = printable(str(metrics.get("first_error")))
    return f"  {int(metrics['rollout_errors'])} rollouts failed; first error: {first_error}"


def _summary_lines(history: list[dict]) -> list[str]:
    """The end of a run against its noise: first and last windows of the reward with the interval of their
    difference, and the held-out evaluations' first and last."""
    from agentrl.stats import window_delta

    lines = []
    delta = window_delta([row.get("reward", float("nan")) for row in history], 20)
    if delta is not None:
        # One line of at most 120 characters, however the run went (rewards of several digits included).
        lines.append(f"reward, first {delta.n} steps -> last {delta.n}: {delta.text()}"
                     + ("" if delta.significant else "; no change shown"))
    evals = [row for row in history if "eval/mean_reward" in row]
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(
            f"held-out mean reward after step {first['eval/step'] + 1}: {first['eval/mean_reward']:.3f} (95% CI "
            f"{first['eval/mean_reward_low']:.3f}-{first['eval/mean_reward_high']:.3f}) -> after step "
            f"{last['eval/step'] + 1}: {last['eval/mean_reward']:.3f} (95% CI {last['eval/mean_reward_low']:.3f}"
            f"-{last['eval/mean_reward_high']:.3f})"
        )
    return lines


_SET_OPTION = typer.Option([], "--set", help="Override a config key, e.g. steps=100.")
_DRY_RUN_OPTION = typer.Option(False, "--dry-run", help="Print the resolved config and exit.")
"""The `--set` and `--dry-run` options of `agentrl sft` and `agentrl pretrain`."""


def _config_or_dry_run(model: type, config: Path | None, overrides: list[str], *, dry_run: bool) -> tuple[Any, Any]:
    """A command's console and its config loaded with `--set` overrides; with `--dry-run`, the config printed and
    the command ended."""
    from rich.console import Console

    from agentrl.config import dump_config, load_config

    console = Console()
    resolved = load_config(model, config, overrides=list(overrides))
    if dry_run:
        console.print(dump_config(resolved), markup=False, highlight=False)
        raise typer.Exit(0)
    return console, resolved


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_command(
        env: str | None = typer.Option(None, "--env", "-e", help="Environment (default reverse-text)."),
        model: str | None = typer.Option(None, "--model", "-m", help="Model preset or HF folder (default tiny-moe)."),
        config: Path | None = typer.Option(None, "--config", "-c", help="TOML run config (see cookbook/)."),
        overrides: list[str] = typer.Option([], "--set", help="Override a config key, e.g. orchestrator.max_steps=10."),
        dry_run: bool = typer.Option(
            False,
            "--dry-run",
            help="Print the resolved config and the full plan (nodes, GPUs, layout, "
            "vLLM commands, memory per GPU) and exit.",
        ),
        resume: Path | None = typer.Option(
            None, "--resume", help="Continue the run in this folder from its last checkpoint."
        ),
        ray_address: str | None = typer.Option(
            None, "--ray-address", help="Join this Ray cluster instead of starting a local one."
        ),
        output: Path | None = typer.Option(
            None, "--output", "-o", help="Run folder (default runs/<env>-<model>-<time>)."
        ),
        gpus: int | None = typer.Option(
            None, "--gpus", help="GPUs of the cluster, split by the planner (= --set launch.gpus=N)."
        ),
        seq_len: int | None = typer.Option(
            None, "--seq-len", help="Longest sample in tokens (= --set model.max_seq_len=N)."
        ),
    ) -> None:
        """Train a policy with asynchronous RL: rollouts on vLLM, trainer steps, live weight updates.

        With no arguments: reverse-text on tiny-moe on this CPU, from the committed SFT warm start.
        Writes config.toml, metrics.jsonl, checkpoints, plots and report.md to the run folder.
        """
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from agentrl.config import dump_config
        from agentrl.rl.config import load_run_config

        console = Console(soft_wrap=True)  # piped output: whole lines, never wrapped at 80 columns
        extra = list(overrides)
        if ray_address:
            extra.append(f'launch.ray_address="{ray_address}"')
        if gpus is not None:
            extra.append(f"launch.gpus={gpus}")
        if seq_len is not None:
            extra.append(f"model.max_seq_len={seq_len}")
        if resume is not None:
            from agentrl.rl.report import RunDir

            RunDir(resume).require_existing()
            if config is not None or env or model:
                console.print("note: --resume reuses the run's config.toml; --config/--env/--model are ignored")
            resolved = load_run_config(resume / "config.toml", overrides=extra)
            run_dir = resume
        else:
            resolved = load_run_config(config, overrides=extra, env=env, model=model)
            run_dir = output or Path(resolved.run.output_dir) / (resolved.run.name or _run_name(resolved.env.name,
                                                                                                resolved.model.name))
        from agentrl.hub.loader import check_environment_args, require_environment

        require_environment(resolved.env.name)  # an unknown environment is one line before anything starts
        check_environment_args(resolved.env.name, resolved.env.args)  # and so is an argument it does not take
        from agentrl.models import resolve_model

        resolve_model(resolved.model.name)  # so is an unknown model, before the run's folder is named
        if resume is None:
            from agentrl.rl.report import RunDir

            RunDir(run_dir).require_new()  # an earlier run there: one line, before the start-up's output
        from agentrl.rl.config import warn_random_start

        if dry_run:
            warn_random_start(resolved)
            from agentrl.rl.plan import plan_run

            console.print(plan_run(resolved), markup=False, highlight=False)  # the plan first, then what it planned
            console.print(
                "\n## resolved config (agentrl train --config takes it as it is)", markup=False, highlight=False
            )
            console.print(dump_config(resolved), markup=False, highlight=False)
            raise typer.Exit(0)
        from agentrl.hub.loader import load_environment
        from agentrl.hub.sandbox_check import check_sandboxes

        # sandbox images / rootfs missing: one line with the command that builds them, before any start-up
        check_sandboxes(load_environment(resolved.env.name, **resolved.env.args))
        warn_random_start(resolved)
        from agentrl.rl.launch import run_training
        from agentrl.viewer.serve import view_command

        console.print(f"watch it: {view_command(run_dir)}", markup=False, highlight=False, soft_wrap=True)
        total = resolved.orchestrator.max_steps
        with Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.description}"), console=console, transient=False) as progress:
            task = progress.add_task("starting", total=total)

            started = time.monotonic()

            def on_status(message: str) -> None:  # the start-up's phases with the time since the start
                progress.console.print(f"[{time.monotonic() - started:5.1f}s] {message}", markup=False, highlight=False)
                progress.update(task, description=message)

            step_times: list[float] = []
            flat_steps = [0, False]  # steps in a row whose every group had one reward; said once

            def on_step(metrics: dict) -> None:
                step_times.append(float(metrics.get("step_time_s") or 0.0))
                recent = step_times[1:][-10:]  # the first step waits for the servers' first answers: not a rate
                eta = sum(recent) / len(recent) * (total - metrics["step"] - 1) if recent else None
                progress.console.print(_step_line(metrics, total=total, eta_s=eta), markup=False, highlight=False)
                held_out = _eval_line(metrics)
                if held_out:
                    progress.console.print(held_out, markup=False, highlight=False)
                failed = _error_line(metrics)
                if failed:
                    progress.console.print(failed, markup=False, highlight=False)
                line = _no_signal_line(metrics, flat_steps)
                if line:
                    progress.console.print(line, markup=False, highlight=False)
                if metrics.get("failed_steps"):
                    progress.console.print(f"  no usable rollout: failed step {metrics['failed_steps']} in a row "
                                           f"(the run stops at {resolved.orchestrator.max_failed_steps})",
                                           markup=False, highlight=False)
                progress.update(task, completed=metrics["step"] + 1, description=f"reward {metrics['reward']:.3f}")

            result = run_training(resolved, run_dir=run_dir, resume=resume is not None, on_step=on_step,
                                  on_status=on_status)
        history = result.history
        for line in _summary_lines(history):
            console.print(line, markup=False, highlight=False)
        console.print(f"run folder: {result.run_dir} (report.md, plots/, checkpoints/)", markup=False, highlight=False)
        console.print(f"view it: {view_command(result.run_dir)}", markup=False, highlight=False, soft_wrap=True)

    @app.command("sft")
    def sft_command(
        config: Path | None = typer.Option(
            None, "--config", "-c", help="TOML SFT config (e.g. cookbook/cpu-default/sft.toml)."
        ),
        overrides: list[str] = _SET_OPTION,
        dry_run: bool = _DRY_RUN_OPTION,
    ) -> None:
        """Supervised warm start: train MODEL on ENV's demonstrations and export an HF folder.

        Demonstrations are the environment's oracle answers played through its own rollout
        and rendered with the model's chat template; the trainer runs in SFT mode.
        """
        from agentrl.rl.sft import SFTConfig, run_sft

        console, resolved = _config_or_dry_run(SFTConfig, config, overrides, dry_run=dry_run)
        every = max(1, resolved.steps // 20)

        def on_step(metrics: dict) -> None:
            if metrics["step"] % every == 0 or metrics["step"] == resolved.steps - 1:
                console.print(f"sft step {metrics['step']:>4}  nll {metrics.get('nll', float('nan')):.4f}  "
                              f"{metrics['elapsed_s']:.0f}s", markup=False, highlight=False)

        output = run_sft(resolved, on_step=on_step)
        console.print(f"exported: {output}")

    @app.command("pretrain")
    def pretrain_command(
        config: Path | None = typer.Option(
            None, "--config", "-c", help="TOML pretraining config (e.g. cookbook/r3-specialised/cpu.toml)."
        ),
        overrides: list[str] = _SET_OPTION,
        dry_run: bool = _DRY_RUN_OPTION,
    ) -> None:
        """Pretrain MODEL on raw text found on this machine until its experts specialise (Router Replay studies).

        Reports the held-out NLL and the routing figures (router entropy, load balance, expert/token
        mutual information, the cost of a routing flip) at initialisation and at the end.
        """
        from agentrl.rl.pretrain import PretrainConfig, run_pretrain

        console, resolved = _config_or_dry_run(PretrainConfig, config, overrides, dry_run=dry_run)
        every = max(1, resolved.steps // 20)

        def on_step(record: dict) -> None:
            if record["step"] % every == 0 or "heldout_nll" in record:
                held = f"  held-out {record['heldout_nll']:.4f}" if "heldout_nll" in record else ""
                console.print(f"pretrain step {record['step']:>5}  nll {record['nll']:.4f}{held}  "
                              f"{record['elapsed_s']:.0f}s", markup=False, highlight=False)

        output = run_pretrain(resolved, on_step=on_step)
        import json

        change = json.loads((output / "pretrain.json").read_text())["change"]
        console.print("figure               init      final", markup=False, highlight=False)
        for key, (before, after) in change.items():
            if before is not None and after is not None:
                console.print(f"{key:<18} {before:>8.4f}  {after:>8.4f}", markup=False, highlight=False)
        console.print(f"run folder: {output} (model/, pretrain.json, metrics.jsonl, plots/)", markup=False,
                      highlight=False)
