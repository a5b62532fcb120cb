"""Tools: typed Python functions as OpenAI tools.

`Tool(func)` reads the function's signature and docstring and offers

- `.schema`: the OpenAI tool JSON (`{"type": "function", "function": {name, description,
  parameters}}`), parameters built by pydantic from the annotations (int, float, str, bool,
  list[...], Literal[...], Optional[...], pydantic models) with per-argument descriptions
  taken from a Google-style `Args:` section of the docstring;
- `await .call(arguments)`: validates and coerces the model's arguments (a JSON string or a
  dict) with the same pydantic model, runs the function (async; sync in a worker thread,
  or on the event loop with `in_thread=False` for fast pure functions) and returns its
  result as text. Bad arguments raise `ToolArgumentError`, whose
  one-line message is meant to be shown to the model.

`hidden=("sandbox",)` names arguments that the environment supplies at call time (a
sandbox handle, the rollout state): they are left out of the schema and of validation.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from agentrl.errors import AgentrlError
from agentrl.types import untrusted_json

__all__ = ["Tool", "ToolArgumentError", "parse_docstring", "tool_schema"]

_SECTION_RE = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_ARG_RE = re.compile(r"^\s*\*{0,2}(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


class ToolArgumentError(AgentrlError):
    """The model called a tool with arguments that do not fit its signature."""


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {argument: description})."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent = 0
    for line in lines:
        header = _SECTION_RE.match(line)
        if header:
            section = header.group(1).lower()
            current = None
            continue
        if section is None:
            description.append(line)
        elif section in ("args", "arguments", "parameters"):
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            match = _ARG_RE.match(line)
            if match and (current is None or indent <= arg_indent):
                current = match.group(1)
                arg_indent = indent
                args[current] = match.group(3).strip()
            elif current is not None:
                args[current] = (args[current] + " " + line.strip()).strip()
    return " ".join(" ".join(description).split()), args


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {
            key: _strip_titles(value) for key, value in schema.items()
            if not (key == "title" and isinstance(value, str))
        }
    if isinstance(schema, list):
        return [_strip_titles(value) for value in schema]
    return schema


class Tool:
    """A typed Python function the model can call."""

    def __init__(
        self, func: Callable[..., Any], *, name: str | None = None, description: str | None = None,
        hidden: Sequence[str] = (),
        in_thread: bool = True,
    ) -> None:
        if not callable(func):
            raise AgentrlError(f"Tool: {func!r} is not callable")
        self.func = func
        self.name = name or getattr(func, "__name__", type(func).__name__)
        if not re.fullmatch(r"[A-Za-z_][\w\-]{0,63}", self.name):
            raise AgentrlError(f"Tool: name {self.name!r} must be letters, digits, '_' or '-' (at most 64)")
        doc_description, arg_docs = parse_docstring(inspect.getdoc(func))
        self.description = description if description is not None else doc_description
        try:
            hints = get_type_hints(func)
        except Exception as exc:  # noqa: BLE001 - unresolvable annotation
            raise AgentrlError(f"Tool {self.name!r}: cannot resolve type annotations: {exc}") from None
        fields: dict[str, Any] = {}
        self._positional_only: list[str] = []
        parameters_by_name = inspect.signature(func).parameters
        unknown_hidden = sorted(set(hidden) - set(parameters_by_name))
        if unknown_hidden:
            raise AgentrlError(f"Tool {self.name!r}: hidden argument(s) {', '.join(unknown_hidden)} are not parameters")
        self.hidden: tuple[str, ...] = tuple(hidden)
        """Arguments the environment supplies (a sandbox, the rollout state); the model never sees them."""
        for param in parameters_by_name.values():
            if param.name in self.hidden:
                if param.kind is inspect.Parameter.POSITIONAL_ONLY:
                    raise AgentrlError(f"Tool {self.name!r}: hidden argument {param.name!r} cannot be positional-only")
                continue
            if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise AgentrlError(
                    f"Tool {self.name!r}: *args/**kwargs cannot be described to a model; name each argument"
                )
            if param.name not in hints:
                raise AgentrlError(f"Tool {self.name!r}: argument {param.name!r} needs a type annotation")
            if param.kind is inspect.Parameter.POSITIONAL_ONLY:
                self._positional_only.append(param.name)
            default = ... if param.default is inspect.Parameter.empty else param.default
            fields[param.name] = (hints[param.name], Field(default, description=arg_docs.get(param.name) or None))
        self.args_model: type[BaseModel] = create_model(  # type: ignore[call-overload]
            f"{self.name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
        )
        self._field_names = tuple(self.args_model.model_fields)
        parameters = _strip_titles(self.args_model.model_json_schema())
        parameters.setdefault("properties", {})
        parameters.setdefault("required", [])
        parameters.pop("additionalProperties", None)
        self.parameters = parameters
        self.is_async = inspect.iscoroutinefunction(func)
        self.in_thread = in_thread
        """Run a sync function in a worker thread (it may block); False for fast pure functions."""

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI tool definition."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: str | dict[str, Any] | None) -> dict[str, Any]:
        """Decode and check arguments; returns them coerced to the annotated types."""
        if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = untrusted_json(arguments)
            except json.JSONDecodeError as exc:
                raise ToolArgumentError(
                    f"{self.name}: arguments are not valid JSON ({exc.msg} at char {exc.pos})"
                ) from None
            except ValueError as exc:  # NaN, Infinity, or nested too deeply
                raise ToolArgumentError(f"{self.name}: arguments are not plain JSON ({exc})") from None
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"{self.name}: arguments must be a JSON object, got {type(arguments).__name__}")
        try:
            model = self.args_model.model_validate(arguments)
        except ValidationError as exc:
            problems = []
            for error in exc.errors():
                where = ".".join(str(part) for part in error["loc"]) or "arguments"
                message = "unexpected argument" if error["type"] == "extra_forbidden" else error["msg"]
                problems.append(f"{where}: {message}")
            raise ToolArgumentError(f"{self.name}: bad arguments: " + "; ".join(problems)) from None
        return {name: getattr(model, name) for name in self._field_names}

    async def call(self, arguments: str | dict[str, Any] | None, *, hidden: dict[str, Any] | None = None) -> str:
        """Validate, run and return the result as text (None -> '', non-strings as JSON).

        `hidden` supplies the hidden arguments (all of them are required).
        """
        values = self.validate(arguments)
        hidden = hidden or {}
        missing = [name for name in self.hidden if name not in hidden]
        if missing:
            raise AgentrlError(
                f"Tool {self.name!r}: the environment did not supply hidden argument(s) {', '.join(missing)}"
            )
        values.update({name: hidden[name] for name in self.hidden})
        positional = [values.pop(name) for name in self._positional_only]
        if self.is_async:
            result = await self.func(*positional, **values)
        else:
            if self.in_thread:
                result = await asyncio.to_thread(self.func, *positional, **values)
            else:
                result = self.func(*positional, **values)
            if inspect.isawaitable(result):
                result = await result
        return _to_text(result)


def _to_text(result: Any) -> str:
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    if isinstance(result, BaseModel):
        return result.model_dump_json()
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


def tool_schema(func: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI tool JSON of a typed function."""
    return Tool(func).schema
