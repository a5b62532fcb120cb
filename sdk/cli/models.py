"""`agentrl models`: the model presets, what they are and the GPUs they need."""

from __future__ import annotations

import typer


def _params(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return str(int(value))


def register(app: typer.Typer) -> None:
    @app.command("models")
    def models_command(
        name: str = typer.Argument(None, help="Show one preset, local folder or cached HF repo id instead of all."),
    ) -> None:
        """List model presets (trainer family, architecture, experts, parameters, context, GPUs needed, local weights).

        Any command that takes --model accepts a preset name, a local HF model folder or an HF
        repo id already in the local Hugging Face cache. tiny-moe is created locally on first use.
        """
        from rich.console import Console
        from rich.table import Table

        from agentrl.models import list_presets, resolve_model

        specs = [resolve_model(name)] if name else [resolve_model(spec.name) for spec in list_presets()]
        table = Table(title="agentrl models", caption="GPUs: H200s for one inference replica / a full RL run")
        for column in ("name", "family", "architecture", "layers x hidden", "experts", "params total/active", "context",
                       "GPUs", "weights"):
            table.add_column(column, no_wrap=column == "name")  # narrow terminals fold the others, not the name
        for spec in specs:
            experts = (
                f"{spec.experts} top-{spec.experts_per_token}"
                + (f" +{spec.shared_experts}" if spec.shared_experts else "")
                if spec.is_moe
                else "dense"
            )
            gpus = "none (CPU)" if spec.inference_gpus == 0 else f"{spec.inference_gpus} / {spec.training_gpus}"
            if spec.hf_repo is None and spec.path is None:
                where = "created locally"
            elif spec.path is not None:
                where = str(spec.path)
            else:
                where = f"{spec.hf_repo} (not cached)"
            table.add_row(
                spec.name, spec.family or "-", spec.architecture, f"{spec.layers} x {spec.hidden_size}", experts,
                f"{_params(spec.total_params)}/{_params(spec.active_params)}", str(spec.context), gpus, where,
            )
        Console().print(table)
