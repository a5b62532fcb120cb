"""Bug injection by AST mutation, deterministic from a seed.

`enumerate_sites(source, path)` walks every function and method of a module and lists the
places one of the operators below can change, in source order; `select_sites` picks a
seeded sample of them (at most a few per function); `apply_site` edits the exact source
span of the node (so the patch touches one line and keeps comments and formatting) and
checks that the edited file parses to the intended tree.

Operators (the SWE-smith / mutation-testing classics):
- flip_comparison: `<` <-> `>=`, `<=` <-> `>`, `==` <-> `!=`, `in` <-> `not in`, `is` <-> `is not`
- off_by_one: an integer literal in arithmetic, an index, a slice, a comparison or a call becomes n-1 (n+1 for 0)
- swap_arguments: the first two positional arguments of a call trade places
- drop_branch: an `if` statement without `else` is deleted
- wrong_constant: `True` <-> `False`
- swap_operator: `+` <-> `-`, `and` <-> `or`
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from dataclasses import dataclass

__all__ = ["OPERATORS", "MutationSite", "apply_site", "enumerate_sites", "select_sites"]

OPERATORS = ("flip_comparison", "off_by_one", "swap_arguments", "drop_branch", "wrong_constant", "swap_operator")

_FLIPPED_COMPARISON: dict[type, type] = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}
_SWAPPED_BINOP: dict[type, type] = {ast.Add: ast.Sub, ast.Sub: ast.Add}
_SWAPPED_BOOLOP: dict[type, type] = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass(frozen=True)
class MutationSite:
    """One possible mutation: where, which operator, and a stable id."""

    path: str
    """File path relative to the repository root."""
    function: str
    """Qualified name of the enclosing function (`Class.method` or `function`)."""
    operator: str
    """One of OPERATORS."""
    line: int
    """1-based line of the mutated node."""
    col: int
    """0-based UTF-8 byte column of the mutated node."""
    index: int
    """Position of the site among all sites of the file (source order)."""
    occurrence: int = 0
    """How many earlier sites share path, function, operator and start (nested nodes such as `a + b + c`)."""

    @property
    def site_id(self) -> str:
        """Stable short id from the path, function, operator, position (and occurrence when > 0)."""
        key = f"{self.path}:{self.function}:{self.operator}:{self.line}:{self.col}"
        if self.occurrence:
            key += f":{self.occurrence}"
        return hashlib.sha256(key.encode()).hexdigest()[:10]


def _functions(tree: ast.Module):
    """Yield (qualified name, node) for module-level functions and methods of module-level classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def _body_nodes(function: ast.AST):
    """Every node inside a function's body (not its decorators, defaults or annotations), in source order."""
    stack = list(reversed(function.body))
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _is_int_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _operators_for(node: ast.AST, parent: ast.AST | None) -> list[str]:
    ops: list[str] = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIPPED_COMPARISON:
        ops.append("flip_comparison")
    if _is_int_literal(node) and isinstance(parent, (ast.BinOp, ast.Subscript, ast.Slice, ast.Compare, ast.Call, ast.UnaryOp)):
        ops.append("off_by_one")
    if (isinstance(node, ast.Call) and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args[:2])
            and ast.dump(node.args[0]) != ast.dump(node.args[1])):
        ops.append("swap_arguments")
    if isinstance(node, ast.If) and not node.orelse and isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.For, ast.While, ast.If, ast.With, ast.Try)):
        ops.append("drop_branch")
    if isinstance(node, ast.Constant) and type(node.value) is bool:
        ops.append("wrong_constant")
    if (isinstance(node, ast.BinOp) and type(node.op) in _SWAPPED_BINOP) or (
            isinstance(node, ast.BoolOp) and type(node.op) in _SWAPPED_BOOLOP):
        ops.append("swap_operator")
    return ops


def enumerate_sites(source: str, path: str) -> list[MutationSite]:
    """Every mutation site of a module, in source order (deterministic)."""
    tree = ast.parse(source)
    sites: list[MutationSite] = []
    seen: dict[tuple[str, str, int, int], int] = {}
    for qualname, function in _functions(tree):
        parents: dict[int, ast.AST] = {}
        for node in ast.walk(function):
            for child in ast.iter_child_nodes(node):
                parents[id(child)] = node
        for node in _body_nodes(function):
            if not hasattr(node, "lineno"):
                continue
            for operator in _operators_for(node, parents.get(id(node))):
                key = (qualname, operator, node.lineno, node.col_offset)
                occurrence = seen.get(key, 0)
                seen[key] = occurrence + 1
                sites.append(MutationSite(path=path, function=qualname, operator=operator, line=node.lineno,
                                          col=node.col_offset, index=len(sites), occurrence=occurrence))
    return sites


def select_sites(sites: list[MutationSite], *, seed: int, max_per_function: int = 3,
                 limit: int | None = None) -> list[MutationSite]:
    """A seeded sample of sites: shuffled, at most `max_per_function` per function, at most `limit`."""
    order = sorted(sites, key=lambda site: (site.path, site.index))
    random.Random(seed).shuffle(order)
    per_function: dict[tuple[str, str], int] = {}
    chosen: list[MutationSite] = []
    for site in order:
        key = (site.path, site.function)
        if per_function.get(key, 0) >= max_per_function:
            continue
        per_function[key] = per_function.get(key, 0) + 1
        chosen.append(site)
        if limit is not None and len(chosen) >= limit:
            break
    return chosen


def _find_node(tree: ast.Module, site: MutationSite) -> tuple[ast.AST, ast.AST]:
    for qualname, function in _functions(tree):
        if qualname != site.function:
            continue
        parents: dict[int, ast.AST] = {}
        for node in ast.walk(function):
            for child in ast.iter_child_nodes(node):
                parents[id(child)] = node
        matches = 0
        for node in _body_nodes(function):
            if (getattr(node, "lineno", None) == site.line and node.col_offset == site.col
                    and site.operator in _operators_for(node, parents.get(id(node)))):
                if matches == site.occurrence:
                    return node, parents[id(node)]
                matches += 1
    raise LookupError(f"mutation site {site.site_id} not found in {site.path}")


_OP_TEXT: dict[type, str] = {
    ast.Lt: "<", ast.GtE: ">=", ast.LtE: "<=", ast.Gt: ">", ast.Eq: "==", ast.NotEq: "!=",
    ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not",
    ast.Add: "+", ast.Sub: "-", ast.And: "and", ast.Or: "or",
}
_OP_PATTERN = {
    "<": r"<(?!=)", ">": r">(?!=)", "<=": r"<=", ">=": r">=", "==": r"==", "!=": r"!=",
    "in": r"(?<![\w])in(?![\w])", "not in": r"not\s+in", "is": r"(?<![\w])is(?!\s+not)(?![\w])", "is not": r"is\s+not",
    "+": r"\+", "-": r"-", "and": r"(?<![\w])and(?![\w])", "or": r"(?<![\w])or(?![\w])",
}

Span = tuple[int, int, int, int]  # start line (1-based), start byte col, end line, end byte col


def _span(node: ast.AST) -> Span:
    return node.lineno, node.col_offset, node.end_lineno, node.end_col_offset


def _between(left: ast.AST, right: ast.AST) -> Span:
    return left.end_lineno, left.end_col_offset, right.lineno, right.col_offset


def _text(lines: list[bytes], span: Span) -> str:
    l1, c1, l2, c2 = span
    if l1 == l2:
        return lines[l1 - 1][c1:c2].decode()
    parts = [lines[l1 - 1][c1:]] + lines[l1:l2 - 1] + [lines[l2 - 1][:c2]]
    return b"".join(parts).decode()


def _operator_edit(lines: list[bytes], span: Span, old: type, new: type) -> tuple[Span, str] | None:
    """Replace the operator token inside `span` (the text between two operands)."""
    text = _text(lines, span)
    matches = list(re.finditer(_OP_PATTERN[_OP_TEXT[old]], text))
    if len(matches) != 1:
        return None
    match = matches[0]
    return span, text[: match.start()] + _OP_TEXT[new] + text[match.end():]


def _edits(lines: list[bytes], node: ast.AST, operator: str) -> list[tuple[Span, str]] | None:
    """Minimal text edits (span -> new text) that perform the mutation."""
    if operator == "flip_comparison":
        old = type(node.ops[0])
        edit = _operator_edit(lines, _between(node.left, node.comparators[0]), old, _FLIPPED_COMPARISON[old])
        return [edit] if edit else None
    if operator == "swap_operator" and isinstance(node, ast.BinOp):
        old = type(node.op)
        edit = _operator_edit(lines, _between(node.left, node.right), old, _SWAPPED_BINOP[old])
        return [edit] if edit else None
    if operator == "swap_operator":
        old = type(node.op)
        edits = [_operator_edit(lines, _between(a, b), old, _SWAPPED_BOOLOP[old]) for a, b in zip(node.values, node.values[1:])]
        return None if None in edits else edits
    if operator == "off_by_one":
        return [(_span(node), str(1 if node.value == 0 else node.value - 1))]
    if operator == "wrong_constant":
        return [(_span(node), str(not node.value))]
    if operator == "swap_arguments":
        first, second = node.args[0], node.args[1]
        return [(_span(first), _text(lines, _span(second))), (_span(second), _text(lines, _span(first)))]
    raise ValueError(f"unknown operator {operator!r}")


def _apply_edits(lines: list[bytes], edits: list[tuple[Span, str]]) -> list[bytes]:
    for (l1, c1, l2, c2), text in sorted(edits, key=lambda edit: edit[0][:2], reverse=True):
        head, tail = lines[l1 - 1][:c1], lines[l2 - 1][c2:]
        lines = lines[: l1 - 1] + [head + text.encode() + tail] + lines[l2:]
    return lines


def _mutate_tree(node: ast.AST, parent: ast.AST, operator: str) -> None:
    """Apply the mutation to the tree itself (the reference the edited source must parse to)."""
    if operator == "flip_comparison":
        node.ops[0] = _FLIPPED_COMPARISON[type(node.ops[0])]()
    elif operator == "off_by_one":
        node.value = 1 if node.value == 0 else node.value - 1
    elif operator == "swap_arguments":
        node.args[0], node.args[1] = node.args[1], node.args[0]
    elif operator == "wrong_constant":
        node.value = not node.value
    elif operator == "swap_operator":
        node.op = (_SWAPPED_BINOP if isinstance(node, ast.BinOp) else _SWAPPED_BOOLOP)[type(node.op)]()
    elif operator == "drop_branch":
        for field in ("body", "orelse", "finalbody"):
            siblings = getattr(parent, field, None)
            if isinstance(siblings, list) and node in siblings:
                siblings.remove(node)
                return


def apply_site(source: str, site: MutationSite) -> str | None:
    """The module's source with the mutation applied, or None when the edit cannot be made cleanly."""
    tree = ast.parse(source)
    node, parent = _find_node(tree, site)
    lines = source.encode().splitlines(keepends=True)
    if site.operator == "drop_branch":
        siblings = next((getattr(parent, f) for f in ("body", "orelse", "finalbody")
                         if node in getattr(parent, f, [])), [])
        if len(siblings) < 2:
            return None
        before = lines[node.lineno - 1][: node.col_offset]
        after = lines[node.end_lineno - 1][node.end_col_offset:].split(b"#")[0]
        if before.strip() or after.strip():
            return None
        mutated_lines = lines[: node.lineno - 1] + lines[node.end_lineno:]
    else:
        edits = _edits(lines, node, site.operator)
        if not edits:
            return None
        mutated_lines = _apply_edits(lines, edits)
    _mutate_tree(node, parent, site.operator)
    try:
        mutated = b"".join(mutated_lines).decode()
    except UnicodeDecodeError:
        return None
    if mutated == source or not _same_tree(mutated, tree):
        return None
    return mutated


def _same_tree(source: str, expected: ast.Module) -> bool:
    try:
        return ast.dump(ast.parse(source)) == ast.dump(expected)
    except SyntaxError:
        return False
