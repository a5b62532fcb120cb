"""`agentrl eval`: evaluate a model on an environment, with a progress bar and a summary table."""

from __future__ import annotations

from pathlib import Path

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


def _compare_with_baseline(resolved, summary, console, on_server) -> None:
    """For a `agentrl train` checkpoint (RUN/checkpoints/step_N): evaluate the run's base model too, one table."""
    from agentrl.evaluation.compare import Comparison, comparison_table, run_baseline

    baseline = run_baseline(resolved.model) if resolved.base_url is None else None
    if baseline is None:
        return
    from agentrl.evaluation.engine import run_evaluation

    console.print(f"baseline: {baseline} (the model this run started from)")
    output = (
        Path(summary.output_dir).with_name(Path(summary.output_dir).name + "-baseline") if summary.output_dir else None
    )
    base = run_evaluation(resolved.model_copy(update={"model": baseline, "output": output}), progress=True,
                          on_server=on_server)
    console.print(comparison_table(Comparison(checkpoint=summary, baseline=base)))
    if summary.output_dir and base.output_dir:
        from agentrl.viewer.serve import view_command

        console.print(f"side by side: {view_command(summary.output_dir, base.output_dir)}", markup=False,
                      highlight=False, soft_wrap=True)


_FLAG_NAMES = {
    ("env",): "--env", ("model",): "--model", ("n",): "-n/--num-tasks",
    ("rollouts_per_task",): "-r/--rollouts-per-task",
    ("split",): "--split", ("base_url",): "--base-url", ("api_key",): "--api-key", ("client",): "--client",
    ("max_concurrent",): "--max-concurrent", ("output",): "--output", ("seed",): "--seed",
    ("sampling", "max_tokens"): "--max-tokens", ("sampling", "temperature"): "--temperature",
    ("sampling", "seed"): "--seed", ("oracle",): "--oracle",
}
"""The command-line flag of each EvalConfig key `agentrl eval` sets, named in that key's errors."""


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_command(
        env: str | None = typer.Option(None, "--env", "-e",
                                          help="Environment name or package folder (default: reverse-text)."),
        model: str | None = typer.Option(None, "--model", "-m",
                                            help="Preset, local HF folder or HF repo id (served model name with "
                                                 "--base-url) (default: tiny-moe)."),
        n: int | None = typer.Option(None, "-n", "--num-tasks",
                                        help="Number of tasks drawn from the split (default: 64)."),
        rollouts: int | None = typer.Option(None, "-r", "--rollouts-per-task",
                                               help="Rollouts per task, the k of avg@k and pass@k (default: 4)."),
        split: str | None = typer.Option(None, help="Dataset split (default: test)."),
        base_url: str | None = typer.Option(None, help="A running OpenAI-compatible/vLLM server; "
                                                          "default: start a vLLM server for the run."),
        api_key: str | None = typer.Option(None, help="API key for --base-url (default: $OPENAI_API_KEY)."),
        client: str | None = typer.Option(None, help="auto, token (vLLM token in/out) or openai (default: auto)."),
        max_tokens: int | None = typer.Option(None, help="Most tokens per model call (default: 128)."),
        temperature: float | None = typer.Option(None, help="Sampling temperature, 0 is greedy (default: 1.0)."),
        max_concurrent: int | None = typer.Option(None, help="Most rollouts in flight (default: 128)."),
        seed: int | None = typer.Option(None, "--seed", help="Seed of the task draw and of sampling (default: 0; "
                                        "a checkpoint and its base model get the same)."),
        output: Path | None = typer.Option(None, "--output", "-o",
                                              help="Results folder (default runs/eval-<env>-<model>-<time>/)."),
        config: Path | None = typer.Option(None, "--config", "-c", help="TOML file with EvalConfig keys."),
        overrides: list[str] = typer.Option([], "--set", help="Override a config key, e.g. sampling.top_p=0.9."),
        oracle: bool = typer.Option(False, "--oracle", help="Play the environment package's own oracle "
                                    "(oracle_policy(): its reference solutions) instead of a model, with no server; "
                                    "exits 1 unless every rollout passes."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
    ) -> None:
        """Run N tasks x R rollouts of ENV with MODEL; write results.jsonl and summary.json.

        Without --base-url a vLLM server for the model is started and stopped around the run.
        Prints mean reward, avg@k, pass@k, tokens and time.
        """
        from rich.console import Console

        from agentrl.config import config_from_dict, dump_config
        from agentrl.evaluation.engine import EvalConfig, run_evaluation

        # Flags given on the command line win over the TOML file; --set wins over both.
        flags = {"env": env, "model": model, "n": n, "rollouts_per_task": rollouts, "split": split,
                 "base_url": base_url, "api_key": api_key, "client": client, "max_concurrent": max_concurrent,
                 "output": str(output) if output else None, "seed": seed, "oracle": True if oracle else None}
        sampling = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
        data, text, source = {}, "", "<defaults>"
        if config is not None:
            from agentrl.config import read_toml

            (data, text), source = read_toml(config), str(config)
        data.update({key: value for key, value in flags.items() if value is not None})
        if any(value is not None for value in sampling.values()):
            table = data.setdefault("sampling", {})
            if isinstance(table, dict):
                table.update({key: value for key, value in sampling.items() if value is not None})
        given = {**{(key,): value for key, value in flags.items()},
                 **{("sampling", key): value for key, value in sampling.items()}}
        resolved = config_from_dict(EvalConfig, data, source=source, text=text, overrides=list(overrides),
                                    flags={key: _FLAG_NAMES[key] for key, value in given.items() if value is not None})
        console = Console()
        if dry_run:
            from agentrl.evaluation.engine import check_evaluation

            check_evaluation(resolved)  # what a real run refuses before start-up, refused here too
            console.print(dump_config(resolved), markup=False)
            raise typer.Exit(0)

        def on_server(server) -> None:
            console.print(f"starting vLLM for {server.model} on {server.url} (about a minute on a 2-core CPU)")

        from agentrl.cli.serve import interrupt_on_sigterm

        interrupt_on_sigterm()
        summary = run_evaluation(resolved, progress=True, on_server=on_server)
        console.print(summary_table(summary))
        if summary.output_dir:
            from agentrl.viewer.serve import view_command

            console.print(f"view it: {view_command(summary.output_dir)}", markup=False, highlight=False,
                          soft_wrap=True)
        from agentrl.cli import printable

        first_error = printable(str(summary.first_error))  # sandbox or server text: shown, never interpreted
        if summary.num_rollouts and summary.errors == summary.num_rollouts:
            typer.echo(f"error: all {summary.num_rollouts} rollouts failed; first error: {first_error}", err=True)
            raise typer.Exit(1)
        if summary.errors:
            console.print(f"{summary.errors} rollouts failed; first error: {first_error}", style="yellow",
                          markup=False, highlight=False, soft_wrap=True)
        if summary.grader_errors:  # scored 0, not failed: a task's verifier that wrote no reward, or caught tampering
            scored = summary.num_rollouts - summary.errors
            console.print(f"{summary.grader_errors} of {scored} scored rollouts got no reward from the grader (scored "
                          f"0); first: {printable(str(summary.first_grader_error))}", style="yellow", markup=False,
                          highlight=False, soft_wrap=True)
        if resolved.oracle:  # a package check: its reference solutions must all be paid
            passed = round(summary.pass_at_k.get("1", 0.0) * summary.num_rollouts)
            if passed < summary.num_rollouts or not summary.num_rollouts:
                typer.echo(f"error: the oracle passed {passed} of {summary.num_rollouts} rollouts (reward >= "
                           f"{resolved.pass_threshold:g}); see {summary.output_dir}/results.jsonl", err=True)
                raise typer.Exit(1)
            console.print(f"oracle: all {summary.num_rollouts} rollouts passed", markup=False, highlight=False)
            return
        _compare_with_baseline(resolved, summary, console, on_server)
