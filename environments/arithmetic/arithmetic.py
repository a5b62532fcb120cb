"""arithmetic: integer arithmetic problems solved with a calculator tool (multi-turn).

Each task is an expression of 2-4 integers joined by +, - and *, generated from a seed.
The model may call `calculator(expression)`, a safe evaluator over Python's `ast` (numbers,
+ - * / // % **, parentheses, unary signs; no names, calls or attributes; exponents and
magnitudes bounded), and ends by replying `<answer>NUMBER</answer>`. Reward: exact match
of that number (or, without tags, the last number of the final reply) with the result.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re

from agentrl.environment import rows_to_dataset
from agentrl.parsers import XMLParser
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.rubric import Rubric
from agentrl.tool_env import ToolEnv
from agentrl.tools import Tool

SYSTEM_PROMPT = (
    "Solve the arithmetic problem. You can call the calculator tool. "
    "When you know the result, reply with <answer>NUMBER</answer>."
)
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30
MAX_EXPRESSION_CHARS = 200

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_parser = XMLParser(fields=["answer"])


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        if abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("the result is too large")
        return value
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def safe_eval(expression: str) -> int | float:
    """Evaluate an arithmetic expression without eval(); raises CalculatorError."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None
    return _evaluate(tree)


def format_number(value: float) -> str:
    """An integral value without a fractional part, others rounded to 10 significant digits."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, using numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 12".
    """
    try:
        return format_number(safe_eval(expression))
    except CalculatorError as exc:
        return f"Error: {exc}"


def make_expression(rng: random.Random) -> str:
    """2-4 integers in 1..99 joined by +, - or *."""
    numbers = [rng.randint(1, 99) for _ in range(rng.randint(2, 4))]
    expression = str(numbers[0])
    for number in numbers[1:]:
        expression += f" {rng.choice('+-*')} {number}"
    return expression


def make_rows(count: int, *, seed: int, exclude: set[str] = frozenset(), split: str = "train") -> list[dict]:
    """`count` distinct problems (expressions in `exclude` skipped), deterministic in `seed`."""
    rng = random.Random(seed)
    rows: list[dict] = []
    seen = set(exclude)
    while len(rows) < count:
        expression = make_expression(rng)
        if expression in seen:
            continue
        seen.add(expression)
        rows.append({
            "prompt": [{"role": "user", "content": f"Compute: {expression}"}],
            "answer": format_number(safe_eval(expression)),
            "info": {"expression": expression, "split": split},
            "task": "arithmetic",
            "example_id": f"{split}-{len(rows)}",
        })
    return rows


def build_dataset(*, num_train: int = 2000, num_test: int = 200, seed: int = 0) -> dict:
    """Train and test splits as `datasets.Dataset`s; no test expression appears in train."""
    test_rows = make_rows(num_test, seed=seed + 1, split="test")
    train_rows = make_rows(
        num_train, seed=seed, exclude={r["info"]["expression"] for r in test_rows}, split="train"
    )
    return {"train": rows_to_dataset(train_rows), "test": rows_to_dataset(test_rows)}


def final_reply(completion) -> str | None:
    """The text of the final message when the model wrote it (None if a tool or nobody did)."""
    if isinstance(completion, str):
        return completion
    if completion and completion[-1].role == "assistant":
        return completion[-1].content
    return None


def final_answer(completion) -> str | None:
    """The <answer> of the final reply, else its last number, else None."""
    reply = final_reply(completion)
    if reply is None:
        return None
    tagged = _parser.parse_answer(reply)
    if tagged is not None:
        return tagged
    numbers = _NUMBER_RE.findall(reply)
    return numbers[-1] if numbers else None


def correct_answer(completion, answer: str) -> float:
    """1.0 when the final answer equals the reference number, else 0.0."""
    given = final_answer(completion)
    if given is None:
        return 0.0
    try:
        return float(math.isclose(float(given.replace(",", "")), float(answer), rel_tol=0, abs_tol=1e-9))
    except ValueError:
        return 0.0


def used_answer_tags(completion) -> float:
    """1.0 when the final reply wraps its answer in <answer> tags (a metric, weight 0)."""
    reply = final_reply(completion)
    return float(reply is not None and _parser.parse_answer(reply) is not None)


def tool_calls(state) -> float:
    """How many tool calls the rollout made (a metric, weight 0)."""
    return float(state.get("tool_calls", 0))


def _oracle_reply(messages, tools):
    if messages[-1].role == "tool":
        return f"<answer>{messages[-1].content}</answer>"
    expression = messages[-1].content.split("Compute:", 1)[-1].strip()
    return {"content": "", "tool_calls": [tool_call("calculator", expression=expression)]}


def oracle_policy() -> ScriptedPolicy:
    """A policy that calls the calculator on the problem and answers with its result."""
    return ScriptedPolicy(_oracle_reply, name="arithmetic-oracle")


def load_environment(
    *, num_train: int = 2000, num_test: int = 200, seed: int = 0, max_turns: int = 6,
    system_prompt: str = SYSTEM_PROMPT,
) -> ToolEnv:
    """The arithmetic environment."""
    splits = build_dataset(num_train=num_train, num_test=num_test, seed=seed)
    rubric = Rubric(funcs=[correct_answer, used_answer_tags, tool_calls], weights=[1.0, 0.0, 0.0], parser=_parser)
    return ToolEnv(
        name="arithmetic", dataset=splits["train"], eval_dataset=splits["test"], tools=[Tool(calculator, in_thread=False)],
        rubric=rubric, parser=_parser, system_prompt=system_prompt, max_turns=max_turns,
    )
