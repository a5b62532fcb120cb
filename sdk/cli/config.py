"""`agentrl config keys [PREFIX]`: every key of the run config (`agentrl train --config` / `--set`) with its type,
default and description, read from the config classes themselves (no torch, vllm or ray)."""

from __future__ import annotations

from typing import Any

import typer

app = typer.Typer(help="The run config's keys (what --config and --set take).", no_args_is_help=True)


def config_keys(model: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every leaf field under `model` (a pydantic config class)."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    from agentrl.config import _unwrap

    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = _unwrap(field.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += config_keys(annotation, f"{key}.")
            continue
        if field.default_factory is not None:
            default = repr(field.default_factory())
        else:
            default = "required" if field.default is PydanticUndefined else repr(field.default)
        kind = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
        description = " ".join((field.description or "").split())
        rows.append((key, kind, default, description))
    return rows


@app.command("keys")
def keys_command(prefix: str | None = typer.Argument(None, help="Only keys under this prefix, e.g. trainer.optimizer."),
                 ) -> None:
    """Print every run-config key: type, default, description (one line each, for pipes and grep)."""
    from agentrl.rl.config import RunConfig

    rows = [row for row in config_keys(RunConfig) if prefix is None or row[0].startswith(prefix)]
    if not rows:
        from agentrl.errors import ConfigError

        raise ConfigError(f"no config key starts with {prefix!r}; `agentrl config keys` lists them all")
    for key, kind, default, description in rows:
        typer.echo(f"{key}  ({kind}, default {default})  {description}")
