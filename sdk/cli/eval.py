"""`agentrl eval`: evaluate a model on an environment, with a progress bar and a summary table."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def summary_table(summary):
    """A rich table of an EvalSummary."""
    from rich.table import Table

    table = Table(title=f"{summary.env} / {summary.model}: {summary.num_tasks} tasks x {summary.rollouts_per_task}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    k = summary.rollouts_per_task
    rows = [("mean reward", f"{summary.mean_reward:.4f} ± {summary.std_reward:.4f}"),
            (f"avg@{k}", f"{summary.avg_at_k:.4f}")]
    rows += [(f"pass@{kk}", f"{value:.4f}") for kk, value in summary.pass_at_k.items()]
    rows += [(f"metric {name}", f"{value:.4f}") for name, value in summary.metrics.items()]
    rows += [
        ("rollouts (errors, truncated)", f"{summary.num_rollouts} ({summary.errors}, {summary.truncated})"),
        ("prompt / completion tokens", f"{summary.prompt_tokens} / {summary.completion_tokens}"),
        ("time", f"{summary.elapsed_s:.1f}s" + (f" (+{summary.server_startup_s:.1f}s server start-up)"
                                                 if summary.server_startup_s else "")),
        ("completion tokens/s", f"{summary.completion_tokens_per_s:.1f}"),
        ("results", str(summary.output_dir)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_command(
        env: str = typer.Option("reverse-text", "--env", "-e", help="Environment name or package folder."),
        model: str = typer.Option("tiny-moe", "--model", "-m",
                                  help="Preset, local HF folder or HF repo id (served model name with --base-url)."),
        n: int = typer.Option(64, "-n", "--num-tasks", help="Number of tasks drawn from the split."),
        rollouts: int = typer.Option(4, "-r", "--rollouts-per-task", help="Rollouts per task (k of avg@k, pass@k)."),
        split: str = typer.Option("test", help="Dataset split."),
        base_url: Optional[str] = typer.Option(None, help="A running OpenAI-compatible/vLLM server; "
                                                          "default: start a vLLM server for the run."),
        api_key: Optional[str] = typer.Option(None, help="API key for --base-url (default: $OPENAI_API_KEY)."),
        client: Optional[str] = typer.Option(None, help="auto, token (vLLM token in/out) or openai."),
        max_tokens: Optional[int] = typer.Option(None, help="Most tokens per model call."),
        temperature: Optional[float] = typer.Option(None, help="Sampling temperature (0: greedy)."),
        max_concurrent: Optional[int] = typer.Option(None, help="Most rollouts in flight."),
        output: Optional[Path] = typer.Option(None, "--output", "-o",
                                              help="Results folder (default runs/eval-<env>-<model>-<time>/)."),
        config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML file with EvalConfig keys."),
        overrides: list[str] = typer.Option([], "--set", help="Override a config key, e.g. sampling.top_p=0.9."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
    ) -> None:
        """Run N tasks x R rollouts of ENV with MODEL; write results.jsonl and summary.json.

        Without --base-url a vLLM server for the model is started and stopped around the run.
        Prints mean reward, avg@k, pass@k, tokens and time.
        """
        from rich.console import Console

        from agentrl.config import dump_config, load_config
        from agentrl.evaluate import EvalConfig, run_evaluation

        flags = [f"env={env!r}", f"model={model!r}", f"n={n}", f"rollouts_per_task={rollouts}", f"split={split!r}"]
        optional = {"base_url": base_url, "api_key": api_key, "client": client, "max_concurrent": max_concurrent,
                    "output": str(output) if output else None, "sampling.max_tokens": max_tokens,
                    "sampling.temperature": temperature}
        flags += [f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
                  for key, value in optional.items() if value is not None]
        resolved = load_config(EvalConfig, config, overrides=[f.replace("'", '"') for f in flags] + list(overrides))
        console = Console()
        if dry_run:
            console.print(dump_config(resolved), markup=False)
            raise typer.Exit(0)

        def on_server(server) -> None:
            console.print(f"starting vLLM for {resolved.model} on {server.url} (log {server.log_path or 'temp file'})")

        summary = run_evaluation(resolved, progress=True, on_server=on_server)
        console.print(summary_table(summary))
        if summary.errors:
            console.print(f"[yellow]{summary.errors} rollouts failed; first error: {summary.first_error}")
