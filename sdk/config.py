"""The one config system: pydantic models loaded from TOML with `--set a.b=c` overrides.

Every component config derives from `BaseConfig` (`extra="forbid"`, a docstring on each
field, which pydantic turns into the field description). `load_config` reads a TOML file,
applies dotted overrides, validates, and turns every failure into a one-line `ConfigError`
that names the file, the line and the key, never a traceback. `dump_config` renders the
resolved config back to TOML (for `--dry-run` and a run's `config.toml`).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import tomli_w
from pydantic import BaseModel, ConfigDict, ValidationError

from agentrl.errors import ConfigError

__all__ = ["BaseConfig", "load_config", "dump_config", "parse_override", "apply_overrides", "config_from_dict"]

ConfigT = TypeVar("ConfigT", bound="BaseConfig")


class BaseConfig(BaseModel):
    """Base of every agentrl config: unknown keys are errors, field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


_TABLE_RE = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_RE = re.compile(r"^\s*([A-Za-z0-9_\-\.\"']+)\s*=")


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map each dotted key path written in a TOML text to its 1-based line number."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), start=1):
        table_match = _TABLE_RE.match(line)
        if table_match:
            table = tuple(part.strip().strip("\"'") for part in table_match.group(1).split("."))
            lines.setdefault(table, number)
            continue
        key_match = _KEY_RE.match(line)
        if key_match:
            key = tuple(part.strip().strip("\"'") for part in key_match.group(1).split("."))
            lines.setdefault(table + key, number)
    return lines


def parse_override(override: str) -> tuple[list[str], Any]:
    """Split `a.b=c` into (["a", "b"], value); the value is read as TOML, else kept as a string."""
    if "=" not in override:
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE, for example --set trainer.lr=1e-5")
    key, raw = override.split("=", 1)
    path = [part for part in key.strip().split(".") if part]
    if not path:
        raise ConfigError(f"--set {override!r}: the key before '=' is empty")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set` overrides to a nested dict in place and return it."""
    for override in overrides:
        path, value = parse_override(override)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {override!r}: {part!r} is a value, not a table")
            node = child
        node[path[-1]] = value
    return data


def _format_validation_error(
    error: ValidationError, *, source: str, key_lines: dict[tuple[str, ...], int], overridden: set[tuple[str, ...]]
) -> str:
    first = error.errors()[0]
    loc = tuple(str(part) for part in first["loc"])
    dotted = ".".join(loc) or "<root>"
    if first["type"] == "extra_forbidden":
        problem = f"unknown key {dotted!r}"
    elif first["type"] == "missing":
        problem = f"missing required key {dotted!r}"
    else:
        problem = f"key {dotted!r}: {first['msg']}"
        if "input" in first and not isinstance(first["input"], (dict, list)):
            problem += f" (got {first['input']!r})"
    if loc in overridden:
        return f"--set {dotted}: {problem}"
    line = None
    for depth in range(len(loc), 0, -1):
        line = key_lines.get(loc[:depth])
        if line is not None:
            break
    where = f"{source}:{line}" if line is not None else source
    more = len(error.errors()) - 1
    suffix = f" (and {more} more error{'s' if more > 1 else ''})" if more else ""
    return f"{where}: {problem}{suffix}"


def config_from_dict(
    model: type[ConfigT], data: dict[str, Any], *, source: str = "<config>", text: str = "",
    overrides: list[str] | None = None,
) -> ConfigT:
    """Validate a nested dict (plus overrides) against a config model with one-line errors."""
    overrides = list(overrides or [])
    overridden = {tuple(parse_override(o)[0]) for o in overrides}
    apply_overrides(data, overrides)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ConfigError(
            _format_validation_error(error, source=source, key_lines=_key_lines(text), overridden=overridden)
        ) from None


def load_config(model: type[ConfigT], path: str | Path | None = None, *, overrides: list[str] | None = None) -> ConfigT:
    """Load `model` from a TOML file (or defaults when `path` is None) with dotted overrides."""
    text = ""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        text = path.read_text()
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: malformed TOML: {error}") from None
    return config_from_dict(model, data, source=source, text=text, overrides=overrides)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def dump_config(config: BaseModel) -> str:
    """Render a config as TOML (None values are left out; TOML has no null)."""
    return tomli_w.dumps(_drop_none(config.model_dump(mode="json")))
