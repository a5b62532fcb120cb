"""Tools: JSON schemas from typed functions and docstrings; argument validation and coercion."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel

from agentrl.errors import AgentrlError
from agentrl.tools import Tool, ToolArgumentError, parse_docstring, tool_schema


def search(query: str, limit: int = 5, *, exact: bool = False, mode: Literal["fast", "full"] = "fast",
           tags: list[str] | None = None, threshold: float | None = None) -> list[str]:
    """Search the notes.

    Longer explanation that wraps
    onto a second line.

    Args:
        query (str): Words to look for.
        limit: Most results
            to return.
        exact: Match whole words only.
        mode: How hard to search.
        tags: Only notes with these tags.
        threshold: Minimum score.

    Returns:
        The matching note titles.
    """
    return [f"{query}:{limit}:{exact}:{mode}:{tags}:{threshold}"]


class Point(BaseModel):
    x: int
    y: int


async def move(point: Point, steps: int) -> Point:
    """Move a point right.

    Args:
        point: Where to start.
        steps: How far.
    """
    await asyncio.sleep(0)
    return Point(x=point.x + steps, y=point.y)


def test_schema_from_annotations_and_docstring():
    schema = tool_schema(search)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "search"
    assert function["description"] == "Search the notes. Longer explanation that wraps onto a second line."
    params = function["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["query"]
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "Words to look for."}
    assert props["limit"] == {"type": "integer", "default": 5, "description": "Most results to return."}
    assert props["exact"]["type"] == "boolean"
    assert props["mode"]["enum"] == ["fast", "full"]
    assert {"type": "array", "items": {"type": "string"}} in props["tags"]["anyOf"]
    assert {"type": "null"} in props["threshold"]["anyOf"]
    assert "title" not in str(schema)


def test_pydantic_model_argument_schema():
    params = Tool(move).parameters
    assert params["required"] == ["point", "steps"]
    ref = params["properties"]["point"]["$ref"].split("/")[-1]
    assert params["$defs"][ref]["properties"] == {"x": {"type": "integer"}, "y": {"type": "integer"}}


async def test_call_coerces_and_runs_sync_and_async():
    assert await Tool(search).call('{"query": "cat", "limit": "3", "tags": ["a"]}') == (
        '["cat:3:False:fast:[\'a\']:None"]'
    )
    assert await Tool(move).call({"point": {"x": 1, "y": 2}, "steps": 4}) == '{"x":5,"y":2}'


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ("{not json", "arguments are not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("{}", "query: Field required"),
        ('{"query": "x", "limit": "many"}', "limit: Input should be a valid integer"),
        ('{"query": "x", "mode": "slow"}', "mode: Input should be 'fast' or 'full'"),
        ('{"query": "x", "colour": 1}', "colour: unexpected argument"),
    ],
)
async def test_bad_arguments_raise_one_line_errors(arguments, fragment):
    with pytest.raises(ToolArgumentError) as info:
        await Tool(search).call(arguments)
    assert fragment in str(info.value) and str(info.value).startswith("search: ")
    assert "\n" not in str(info.value)


def test_unusable_functions_are_rejected():
    def untyped(x):
        return x

    def star(*values: int) -> int:
        return 0

    with pytest.raises(AgentrlError, match="'x' needs a type annotation"):
        Tool(untyped)
    with pytest.raises(AgentrlError, match=r"\*args/\*\*kwargs"):
        Tool(star)
    with pytest.raises(AgentrlError, match="not callable"):
        Tool("search")


def test_parse_docstring_sections():
    description, args = parse_docstring(search.__doc__)
    assert description.startswith("Search the notes.")
    assert args["limit"] == "Most results to return."
    assert "Returns" not in description and "matching" not in " ".join(args.values())
    assert parse_docstring(None) == ("", {})


async def test_sync_tools_run_in_a_worker_thread_unless_inline():
    import threading

    def where() -> str:
        """Name the thread the tool runs on."""
        return threading.current_thread().name

    main = threading.current_thread().name
    assert await Tool(where).call("{}") != main
    assert await Tool(where, in_thread=False).call("{}") == main


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(("arguments", "said"), [
    ('{"x": ' + DEEP + "}", "nested too deeply"), ('{"x": NaN}', "NaN is not JSON"),
    ('{"x": -Infinity}', "-Infinity is not JSON")])
def test_arguments_that_are_not_plain_json_are_a_tool_error(arguments, said):
    """A tool call nested 5,000 deep raised RecursionError (not a ValueError), which the tool paths let through: the
    rollout became an error and left training (red team, 2026-12-07). NaN and Infinity are not JSON either."""
    def echo(x: list) -> str:
        """Echo.

        Args:
            x: Anything.
        """
        return str(x)

    with pytest.raises(ToolArgumentError, match=said):
        Tool(echo).validate(arguments)


def test_tool_calls_too_deep_or_with_nan_stay_in_the_text():
    from agentrl.chat import parse_tool_calls
    from agentrl.types import FunctionCall

    for arguments in (DEEP, '{"x": NaN}'):
        block = '<tool_call>{"name": "echo", "arguments": ' + arguments + "}</tool_call>"
        content, calls = parse_tool_calls("see " + block)
        assert calls == [] and content == "see " + block
    with pytest.raises(ValueError, match="nested too deeply"):
        FunctionCall(name="echo", arguments=DEEP).parsed_arguments()
