"""The run folder: resolved config, per-step metrics, plots and a short report.

    runs/<name>/
      config.toml        the resolved RunConfig (what `--resume` reloads)
      metrics.jsonl      one JSON object per optimizer step (appended and flushed per step)
      rollouts.jsonl     a sample of each step's rollouts (agentrl.rl.rollout_log; `agentrl view` shows them)
      tensorboard/, wandb/   the step metrics for TensorBoard and W&B, with `run.loggers` (agentrl.rl.loggers)
      checkpoints/       step_N/ (see agentrl.rl.resume)
      plots/             reward.png, mismatch_kl.png, staleness.png, throughput.png, time_split.png,
                         heldout.png (with [eval])
      report.md          summary table, reward first vs last windows with the interval of their difference,
                         the step-time split, the held-out evaluations, links to the plots

`metrics.jsonl` is written so a `kill -9` can at worst leave one partial last line, which
`read_metrics` skips and `truncate_metrics` removes on resume.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError, NotFoundError

__all__ = ["RunDir", "read_metrics", "write_plots", "write_report"]

PLOTS = ("reward", "mismatch_kl", "staleness", "throughput", "time_split", "heldout")
#: (metric, label) of the step-time split: the step's own parts, then a rollout's (rollouts run concurrently)
TIME_SPLIT = (("wait_s", "waiting for rollouts"), ("train_s", "training"), ("weight_stage_s", "weight staging"),
              ("weight_push_s", "weight load into inference"), ("rollout_s", "one rollout"),
              ("rollout_generation_s", "one rollout: generation"), ("rollout_sandbox_s", "one rollout: sandbox"))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics.jsonl (a torn last line is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class RunDir:
    """One run's folder and the files in it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def config_path(self) -> Path:
        return self.path / "config.toml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def plots(self) -> Path:
        return self.path / "plots"

    def lock(self):
        """Hold this folder for this process while it runs (an open file with an exclusive `flock`, released when
        it is closed or the process ends); a second run into the same folder gets one line naming the holder."""
        import fcntl

        self.path.mkdir(parents=True, exist_ok=True)
        handle = open(self.path / ".lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "?"
            handle.close()
            raise AgentrlError(f"{self.path}: another agentrl train (pid {owner}) is writing this run folder; wait "
                               "for it to end, or choose another folder with -o") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        return handle

    def require_new(self) -> RunDir:
        """Check no run is in this folder yet (a new run never overwrites one)."""
        if self.metrics_path.exists() or self.checkpoints.exists():
            raise AgentrlError(
                f"{self.path}: a run already exists there; resume it (--resume {self.path}) or choose another run "
                "folder"
            )
        return self

    def create(self, config_toml: str) -> RunDir:
        """Make the folder for a new run; refuse to overwrite an existing run."""
        self.require_new()
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(config_toml)
        return self

    def require_existing(self) -> RunDir:
        """Check this is a run folder (for --resume)."""
        if not self.config_path.is_file():
            raise NotFoundError(f"{self.path}: not a run folder (no config.toml); pass the folder `agentrl train` made")
        return self

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        """Append one step's metrics as a line and flush it to disk."""
        line = json.dumps(_finite(metrics), sort_keys=True)
        with open(self.metrics_path, "a") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.metrics_path)

    def truncate_metrics(self, *, before_step: int) -> list[dict[str, Any]]:
        """Keep only complete lines of steps < before_step (used when resuming); return them."""
        kept = [row for row in self.metrics() if int(row.get("step", -1)) < before_step]
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in kept))
        os.replace(tmp, self.metrics_path)
        return kept

    def finish(self, *, title: str, plots: bool = True) -> Path:
        """Write the plots and report.md from metrics.jsonl; return the report's path."""
        rows = self.metrics()
        written = write_plots(rows, self.plots) if plots else []
        return write_report(rows, self.path / "report.md", title=title, plots=written, base=self.path)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(int(row["step"]))
            values.append(float(value))
    return steps, values


def write_plots(rows: list[dict[str, Any]], folder: Path) -> list[Path]:
    """PNG plots of reward, mismatch KL, staleness and throughput (matplotlib, Agg)."""
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name: str) -> None:
        path = folder / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps, reward = _series(rows, "reward")
    ax.plot(steps, reward, marker="o", label="mean reward")
    _, std = _series(rows, "reward_std")
    if len(std) == len(reward):
        ax.fill_between(steps, [r - s for r, s in zip(reward, std)], [r + s for r, s in zip(reward, std)], alpha=0.2)
    ax.set_xlabel("step"), ax.set_ylabel("reward"), ax.set_title("Reward"), ax.legend()
    save(fig, "reward")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps, kl = _series(rows, "mismatch_kl")
    ax.plot(steps, kl, marker="o", color="tab:red")
    ax.set_xlabel("step"), ax.set_ylabel("KL(inference || trainer)"), ax.set_title("Mismatch KL")
    save(fig, "mismatch_kl")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    levels = sorted({int(k) for row in rows for k in (row.get("staleness") or {})})
    bottom = [0.0] * len(rows)
    steps = [int(row["step"]) for row in rows]
    for level in levels:
        counts = [float((row.get("staleness") or {}).get(str(level), 0)) for row in rows]
        ax.bar(steps, counts, bottom=bottom, label=f"{level} step{'s' if level != 1 else ''} behind")
        bottom = [b + c for b, c in zip(bottom, counts)]
    dropped = [float(row.get("dropped_stale", 0)) for row in rows]
    if any(dropped):
        ax.bar(steps, dropped, bottom=bottom, label="dropped (too stale)", color="grey")
    ax.set_xlabel("step"), ax.set_ylabel("groups"), ax.set_title("Staleness of trained groups")
    if levels:
        ax.legend(fontsize=8)
    save(fig, "staleness")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps, tps = _series(rows, "tokens_per_s")
    ax.plot(steps, tps, marker="o", label="completion tokens/s")
    ax.set_xlabel("step"), ax.set_ylabel("tokens/s"), ax.set_title("Throughput")
    ax2 = ax.twinx()
    steps2, step_time = _series(rows, "step_time_s")
    ax2.plot(steps2, step_time, color="tab:orange", linestyle="--", label="step time (s)")
    ax2.set_ylabel("step time (s)")
    save(fig, "throughput")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in TIME_SPLIT:
        steps, seconds = _series(rows, key)
        if seconds:
            ax.plot(steps, seconds, label=label, linestyle="--" if key.startswith("rollout") else "-")
    ax.set_xlabel("step"), ax.set_ylabel("seconds"), ax.set_title("Step time split")
    ax.legend(fontsize=7)
    save(fig, "time_split")

    evals = [row for row in rows if isinstance(row.get("eval/mean_reward"), (int, float))]
    if evals:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        steps = [int(row["eval/step"]) for row in evals]
        means = [float(row["eval/mean_reward"]) for row in evals]
        lows = [float(row.get("eval/mean_reward_low") or mean) for row, mean in zip(evals, means)]
        highs = [float(row.get("eval/mean_reward_high") or mean) for row, mean in zip(evals, means)]
        ax.plot(steps, means, marker="o", label="held-out mean reward")
        ax.fill_between(steps, lows, highs, alpha=0.2, label="95% bootstrap interval")
        for key in sorted({key for row in evals for key in row if key.startswith("eval/pass@")}):
            points = [(int(row["eval/step"]), float(row[key])) for row in evals if isinstance(row.get(key), float)]
            ax.plot(*zip(*points), marker=".", linestyle="--", label=key.removeprefix("eval/"))
        ax.set_xlabel("step"), ax.set_ylabel("reward / pass rate"), ax.set_title("Held-out evaluation")
        ax.legend(fontsize=8)
        save(fig, "heldout")
    return written


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _noise_lines(rows: list[dict[str, Any]], reward: list[float]) -> list[str]:
    """The reward's first and last windows with the interval of their difference, and the held-out evaluations."""
    from agentrl.stats import window_delta

    lines = []
    delta = window_delta(reward, 20)
    if delta is not None:
        verdict = "" if delta.significant else " The interval includes 0: this run shows no change of the reward."
        lines += [f"Training reward, mean of the first {delta.n} steps against the last {delta.n} (95% bootstrap "
                  f"interval of the difference): {delta.text()}.{verdict}", ""]
    evals = [row for row in rows if isinstance(row.get("eval/mean_reward"), (int, float))]
    if evals:
        passes = sorted({key for row in evals for key in row if key.startswith("eval/pass@")})
        avg = next((key for key in evals[0] if key.startswith("eval/avg@")), None)
        lines += ["Held-out evaluations (the same tasks each time, never trained on; after step N: the weights of N "
                  "steps, saved as checkpoint step_N where orchestrator.checkpoint_every and run.keep_checkpoints "
                  "kept it):",
                  "",
                  "| after step | tasks | mean reward (95% CI) | " + " | ".join(k.removeprefix("eval/") for k in
                                                                         [*([avg] if avg else []), *passes]) + " |",
                  "|---" * (3 + len(passes) + bool(avg)) + "|"]
        for row in evals:
            cells = [f"{row[key]:.3f}" if isinstance(row.get(key), (int, float)) else "n/a"
                     for key in [*([avg] if avg else []), *passes]]
            lines.append(f"| {row['eval/step'] + 1} | {row.get('eval/tasks')} | {row['eval/mean_reward']:.3f} "
                         f"({row.get('eval/mean_reward_low', float('nan')):.3f}-"
                         f"{row.get('eval/mean_reward_high', float('nan')):.3f}) | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _tool_lines(rows: list[dict[str, Any]]) -> list[str]:
    _, calls = _series(rows, "tool_calls_per_rollout")
    if not calls or not any(calls):
        return []
    failures = sum(int(row.get("tool_call_parse_failures", 0)) for row in rows)
    without = sum(int(row.get("rollouts_without_tool_calls", 0)) for row in rows)
    return [f"| tool calls per rollout, mean | {_mean(calls):.2f} |",
            f"| rollouts without a tool call / tool-call parse failures, all steps | {without} / {failures} |"]


def _large_deviation_line(rows: list[dict]) -> str:
    """The peers' figures of the mismatch, over the steps: tokens whose probabilities differ more than 2x, and
    the largest |log ratio| (the trainer's `mismatch_large_fraction` and `mismatch_max_log_ratio`)."""
    _, share = _series(rows, "train/mismatch_large_fraction")
    _, largest = _series(rows, "train/mismatch_max_log_ratio")
    if not share or not largest:
        return ""
    return (f"| tokens more than 2x apart, mean share / largest log ratio | {_mean(share):.2e} /"
            f" {max(largest):.3f} |")


def _replay_arms_line(rows: list[dict]) -> str:
    """Router Replay's three arms on the same samples (runs with gate weights and the diagnostics): mean KL of
    each."""
    means = []
    for arm in ("live_routing", "replay_ids", "replay_ids_weights"):
        _, values = _series(rows, f"train/mismatch_kl_{arm}")
        if not values:
            return ""
        means.append(_mean(values))
    live, ids, weights = means
    line = (f"| mismatch KL by routing: live / replayed ids / replayed ids + gate weights | {live:.2e} /"
            f" {ids:.2e} / {weights:.2e} |")
    if live <= 0:
        return line
    # What each replay removes, as shares of the live-routing KL (KL is not additive; a first-order split).
    return line + (f"\n| of the live-routing KL: routing flips / gate-weight numerics / the rest (attention, GEMMs,"
                   f" sampler) | {(live - ids) / live:.0%} / {(ids - weights) / live:.0%} / {weights / live:.0%} |")


def write_report(
    rows: list[dict[str, Any]], path: Path, *, title: str, plots: list[Path] = (), base: Path | None = None
) -> Path:
    """A short markdown report: reward first vs last, KL, staleness, throughput, bound, plots."""
    lines = [f"# {title}", ""]
    if not rows:
        lines.append("No step finished.")
        path.write_text("\n".join(lines) + "\n")
        return path
    _, reward = _series(rows, "reward")
    _, kl = _series(rows, "mismatch_kl")
    _, tps = _series(rows, "tokens_per_s")
    _, step_time = _series(rows, "step_time_s")
    window = max(1, len(reward) // 4)
    bounds = [row.get("bound") for row in rows]
    staleness: dict[str, int] = {}
    for row in rows:
        for level, count in (row.get("staleness") or {}).items():
            staleness[level] = staleness.get(level, 0) + int(count)
    dropped = sum(int(row.get("dropped_stale", 0)) for row in rows)
    lines += [
        "| metric | value |",
        "|---|---|",
        f"| steps | {len(rows)} (metrics.jsonl's step {rows[0]['step']} to {rows[-1]['step']}) |",
        f"| reward at the first step | {reward[0]:.4f} |" if reward else "| reward | n/a |",
        f"| reward, mean of the last {window} steps | {_mean(reward[-window:]):.4f} |" if reward else "",
        f"| reward, mean of the first {window} steps | {_mean(reward[:window]):.4f} |" if reward else "",
        f"| mismatch KL (k3), mean / max | {_mean(kl):.5f} / {max(kl):.5f} |" if kl else "| mismatch KL | n/a |",
        _large_deviation_line(rows),
        _replay_arms_line(rows),
        f"| staleness (groups per steps behind) | {json.dumps(dict(sorted(staleness.items())))} |",
        f"| groups dropped as too stale | {dropped} |",
        f"| completion tokens/s, mean | {_mean(tps):.1f} |",
        f"| step time, mean (s) | {_mean(step_time):.2f} |",
        f"| trainer-bound / inference-bound steps | {bounds.count('trainer')} / {bounds.count('inference')} |",
        *[f"| {label} (s), mean | {_mean(values):.2f} |" for key, label in TIME_SPLIT
          for values in [_series(rows, key)[1]] if values],
        *_tool_lines(rows),
        "",
    ]
    lines = [line for line in lines if line != ""] + [""]
    lines += _noise_lines(rows, reward)
    for plot in plots:
        relative = plot.relative_to(base) if base is not None else plot
        lines.append(f"![{plot.stem}]({relative})")
    path.write_text("\n".join(lines) + "\n")
    return path
