"""The one config system: pydantic models loaded from TOML with `--set a.b=c` overrides.

Every component config derives from `BaseConfig` (`extra="forbid"`, a docstring on each
field, which pydantic turns into the field description). `load_config` reads a TOML file,
applies dotted overrides, validates, and turns the failures into one `ConfigError`, never a
traceback: every problem, most specific first (wrong values, then unknown keys, then missing
keys; deeper fields first), joined with '; ' on one line, each naming where it was set, the
field and what it must be:

    run.toml:7: limits.memory_mb = -5: must be at least 16 (MiB); run.toml: missing required key 'name'

A field's unit goes into its messages with `Field(..., json_schema_extra={"unit": "MiB"})`.
`dump_config` renders the resolved config back to TOML (for `--dry-run` and a run's `config.toml`).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

from agentrl.errors import ConfigError

__all__ = ["BaseConfig", "load_config", "dump_config", "parse_override", "apply_overrides", "config_from_dict",
           "over_defaults"]

ConfigT = TypeVar("ConfigT", bound="BaseConfig")


class BaseConfig(BaseModel):
    """Base of every agentrl config: unknown keys are errors, field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


def _merged(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    merged = dict(defaults)
    for key, value in given.items():
        base = merged.get(key)
        merged[key] = _merged(base, value) if isinstance(base, dict) and isinstance(value, dict) else value
    return merged


def over_defaults(defaults: dict[str, Any]):
    """A `field_validator(..., mode="before")` body: a table given for the field is laid over `defaults`.

    For a sub-config whose defaults differ by role (the SFT trainer's loss mode): setting one key
    (`--set trainer.row_tokens=256`) keeps the role's other defaults instead of the sub-config's own.
    """
    def validate(cls: type, value: Any) -> Any:
        return _merged(defaults, value) if isinstance(value, dict) else value

    return validate


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


_RANK_VALUE, _RANK_UNKNOWN, _RANK_MISSING = 0, 1, 2
_MAX_SHOWN = 60  # characters of a wrong value shown in an error

# pydantic error types -> what the value must be (after "must be ")
_EXPECTED_TYPE = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number",
    "bool_type": "a boolean (true or false)", "bool_parsing": "a boolean (true or false)",
    "string_type": "a string", "list_type": "a list", "tuple_type": "a list", "set_type": "a list",
    "dict_type": "a table", "model_type": "a table", "model_attributes_type": "a table",
}
_BOUNDS = {"greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "greater than"),
           "less_than_equal": ("le", "at most"), "less_than": ("lt", "less than")}


def _unwrap(annotation: Any) -> Any:
    """Strip Annotated and Optional: `Annotated[X | None, ...]` -> X (a real union is kept)."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, UnionType):
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return annotation


def _member_tag(member: Any) -> str:
    member = _unwrap(member)
    return member.__name__ if isinstance(member, type) else repr(member)


def _resolve(
    model: type[BaseModel], loc: tuple[Any, ...]
) -> tuple[tuple[str | int, ...], bool, FieldInfo | None]:
    """Walk an error's `loc` through the model: (path without union tags, in a union, the last field)."""
    path: list[str | int] = []
    annotation: Any = model
    field: FieldInfo | None = None
    in_union = False
    for part in loc:
        annotation = _unwrap(annotation)
        if get_origin(annotation) in (Union, UnionType):  # pydantic adds the member's tag to loc
            members = [arg for arg in get_args(annotation) if arg is not type(None)]
            in_union = True
            annotation = next((m for m in members if _member_tag(m) == part), None)
            continue
        path.append(part)
        field = None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part) if isinstance(part, str) else None
            annotation = field.annotation if field is not None else None
        elif get_origin(annotation) in (dict, Mapping) or annotation is dict:
            args = get_args(annotation)
            annotation = args[1] if len(args) == 2 else None
        elif get_origin(annotation) in (list, tuple, set, frozenset, Sequence) and isinstance(part, int):
            args = get_args(annotation)
            annotation = args[0] if args else None
        else:
            annotation = None
    return tuple(path), in_union, field


def _suggestion(model: type[BaseModel], path: tuple[str | int, ...]) -> str:
    """" (did you mean 'x'?)" for an unknown key close to a key of the same table ("" when none is)."""
    import difflib

    annotation: Any = model
    for part in path[:-1]:
        annotation = _unwrap(annotation)
        if (
            not (isinstance(annotation, type) and issubclass(annotation, BaseModel))
            or part not in annotation.model_fields
        ):
            return ""
        annotation = annotation.model_fields[part].annotation
    annotation = _unwrap(annotation)
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)) or not path:
        return ""
    close = difflib.get_close_matches(str(path[-1]), list(annotation.model_fields), n=1, cutoff=0.7)
    if close:
        return f" (did you mean {'.'.join(map(str, (*path[:-1], close[0])))!r}?)"
    # a key of another table: `max_steps` at the top, or in [trainer], for `orchestrator.max_steps`
    nested = [(*path[:-1], *table) for table in _tables_with_key(annotation, str(path[-1]))]
    nested = nested or [table for table in _tables_with_key(model, str(path[-1])) if table != tuple(path[:-1])]
    return f" (did you mean {'.'.join(map(str, (*nested[0], path[-1])))!r}?)" if nested else ""


def _tables_with_key(model: type[BaseModel], key: str, *, depth: int = 3) -> list[tuple[str, ...]]:
    """The paths of the tables below `model` (up to `depth` levels) that have a field named `key`, nearest first."""
    found: list[tuple[str, ...]] = []
    level = [((), model)]
    for _ in range(depth):
        below = []
        for prefix, table in level:
            for name, field in table.model_fields.items():
                annotation = _unwrap(field.annotation)
                if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                    if key in annotation.model_fields:
                        found.append((*prefix, name))
                    below.append(((*prefix, name), annotation))
        level = below
    return found


def _dotted(path: tuple[str | int, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _expected(item: dict[str, Any]) -> tuple[str, bool]:
    """What the value must be: (text, whether it reads after 'must be')."""
    kind = item["type"]
    if kind in _EXPECTED_TYPE:
        return _EXPECTED_TYPE[kind], True
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        return f"{words} {_number(item.get('ctx', {}).get(key))}", True
    message = str(item["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    if message.startswith("Input should be "):
        return message.removeprefix("Input should be "), True
    return message, False


def _format_errors(
    error: ValidationError, *, model: type[BaseModel], source: str, key_lines: dict[tuple[str, ...], int],
    overridden: set[tuple[str, ...]], flags: Mapping[tuple[str, ...], str],
) -> list[str]:
    """One line per problem, most specific first: wrong values, then unknown keys, then missing keys;
    deeper fields before shallower ones. Each names where it comes from (file:line, `--set KEY` or the flag)."""
    grouped: dict[tuple[Any, ...], dict[str, Any]] = {}
    for index, item in enumerate(error.errors()):
        path, in_union, field = _resolve(model, tuple(item["loc"]))
        kind = item["type"]
        rank = {"missing": _RANK_MISSING, "extra_forbidden": _RANK_UNKNOWN}.get(kind, _RANK_VALUE)
        # the members of a union that refused one value are one problem: "must be a string or an integer"
        key = (path, rank) if in_union and rank == _RANK_VALUE else (path, rank, index)
        entry = grouped.setdefault(
            key, {"path": path, "rank": rank, "index": index, "field": field, "items": []}
        )
        entry["items"].append(item)
    lines: list[str] = []
    for entry in sorted(grouped.values(), key=lambda e: (e["rank"], -len(e["path"]), e["index"])):
        path, first = entry["path"], entry["items"][0]
        dotted = _dotted(path) or "<root>"
        if entry["rank"] == _RANK_UNKNOWN:
            problem = f"unknown key {dotted!r}{_suggestion(model, path)}"
        elif entry["rank"] == _RANK_MISSING:
            problem = f"missing required key {dotted!r}"
        else:
            expected = [_expected(item) for item in entry["items"]]
            if all(after_must for _, after_must in expected):
                words = [text for text, _ in expected]
                text = "must be " + (", ".join(words[:-1]) + " or " + words[-1] if words[1:] else words[0])
            else:
                text = " or ".join(("must be " + t) if after_must else t for t, after_must in expected)
            extra = entry["field"].json_schema_extra if entry["field"] is not None else None
            unit = extra.get("unit") if isinstance(extra, dict) else None
            if unit:
                text += f" ({unit})"
            value = first.get("input")
            if not path:
                problem = text
            elif "input" in first and not isinstance(value, dict):
                problem = f"{dotted} = {_shown(value)}: {text}"
            else:
                problem = f"{dotted}: {text}"
        keys = tuple(str(part) for part in path)
        set_by = next((keys[:depth] for depth in range(len(keys), 0, -1) if keys[:depth] in overridden), None)
        if set_by is None and keys:  # a problem of a table that a --set below it made (an unknown table, a check
            set_by = next((key for key in sorted(overridden) if key[:len(keys)] == keys), None)  # across fields)
        if set_by is not None:
            where = f"--set {'.'.join(set_by)}"
        elif keys in flags:
            where = flags[keys]
        else:
            known = [keys[:depth] for depth in range(len(keys), 0, -1) if keys[:depth] in key_lines]
            line = key_lines[known[0]] if known else None
            where = f"{source}:{line}" if line is not None else source
        formatted = f"{where}: {problem}"
        if formatted not in lines:
            lines.append(formatted)
    return lines


def _format_validation_error(
    error: ValidationError, *, model: type[BaseModel], source: str, key_lines: dict[tuple[str, ...], int],
    overridden: set[tuple[str, ...]], flags: Mapping[tuple[str, ...], str],
) -> str:
    """Every problem of a ValidationError on one line, most specific first, joined with '; '."""
    lines = _format_errors(error, model=model, source=source, key_lines=key_lines, overridden=overridden,
                           flags=flags)
    return "; ".join(lines)


def config_from_dict(
    model: type[ConfigT], data: dict[str, Any], *, source: str = "<config>", text: str = "",
    overrides: list[str] | None = None, flags: Mapping[tuple[str, ...], str] | None = None,
) -> ConfigT:
    """Validate a nested dict (plus overrides) against a config model with one-line errors. `flags` names the
    command-line flag that set a key (`{("n",): "-n/--num-tasks"}`), for errors of that key."""
    overrides = list(overrides or [])
    overridden = {tuple(parse_override(o)[0]) for o in overrides}
    apply_overrides(data, overrides)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ConfigError(
            _format_validation_error(
                error, model=model, source=source, key_lines=_key_lines(text), overridden=overridden,
                flags=flags or {},
            )
        ) from None


def load_config(model: type[ConfigT], path: str | Path | None = None, *, overrides: list[str] | None = None) -> ConfigT:
    """Load `model` from a TOML file (or defaults when `path` is None) with dotted overrides."""
    text = ""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        path = Path(path)
        source = str(path)
        data, text = read_toml(path)
    return config_from_dict(model, data, source=source, text=text, overrides=overrides)


def read_toml(path: str | Path) -> tuple[dict[str, Any], str]:
    """A TOML config file's table and text; one-line errors when it is missing, not UTF-8 or not TOML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read it ({error.strerror})") from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: malformed TOML: {error}") from None


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def dump_config(config: BaseModel) -> str:
    """Render a config as TOML (None values are left out; TOML has no null)."""
    return tomli_w.dumps(_drop_none(config.model_dump(mode="json")))
