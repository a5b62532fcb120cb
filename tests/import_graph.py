"""The package's import graph, drawn by import path (the `package-dir` mapping undone), for the layering test.

Every ``import`` and ``from ... import`` of every module under the package folders counts, also those
inside functions (they run when the function does); only imports under ``if TYPE_CHECKING:`` are left out
(they never run). An edge ``a -> b`` means module ``a`` imports module ``b`` (for ``from pkg import
name``: ``pkg.name`` when that is a module, else ``pkg``). `cycles` finds the strongly connected
components of more than one module; `read_layers` reads the layering from docs/DESIGN.md ("Which way
imports go") and `upward_arrows` lists the imports against it.

Run it as a script to print the graph's circles and arrows against the layering:
``python3 tests/import_graph.py``.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"agentrl": "sdk", "agentrl.hub": "hub", "agentrl.inference": "inference",
                "agentrl.trainer": "trainer", "agentrl.environments": "environments",
                "agentrl.cookbook": "cookbook"}
"""Import path -> folder, as pyproject.toml's ``package-dir``."""

DESIGN = ROOT / "docs" / "DESIGN.md"
"""Where the layering is written, once: the table between ``<!-- layers`` and ``<!-- end layers -->``."""


def read_layers(design: Path = DESIGN) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The layers from the bottom up, each with the import paths it holds (docs/DESIGN.md, "Which way imports
    go"): a module may import its own layer and those below it, never one above."""
    text = design.read_text()
    start, end = text.index("<!-- layers"), text.index("<!-- end layers -->")
    layers = []
    for line in text[start:end].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("layer", "---") or not cells[1].startswith("`"):
            continue
        layers.append((cells[0], tuple(re.findall(r"`([\w.]+)`", cells[1]))))
    if not layers:
        raise ValueError(f"{design}: no layer table between <!-- layers and <!-- end layers -->")
    return tuple(layers)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by import path."""
    modules: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            relative = path.relative_to(base)
            if any(part.startswith(".") or part == "__pycache__" or part == "tests" for part in relative.parts):
                continue
            if package == "agentrl" and relative.parts[0] in {name.split(".")[1] for name in PACKAGE_DIRS if "." in name}:
                continue  # a folder of sdk/ shadowed by another package dir (none today)
            parts = list(relative.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[tuple[ast.stmt, bool]]:
    """(import statement, at module level) for every import outside ``if TYPE_CHECKING:``."""

    def walk(node: ast.AST, top: bool) -> Iterator[tuple[ast.stmt, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    yield from walk(other, top)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, top
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, inner)

    yield from walk(tree, True)


def _targets(statement: ast.stmt, module: str, is_package: bool, known: set[str]) -> Iterable[str]:
    if isinstance(statement, ast.Import):
        for alias in statement.names:
            yield alias.name
        return
    assert isinstance(statement, ast.ImportFrom)
    if statement.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - statement.level + 1]
        source = ".".join(base + ([statement.module] if statement.module else []))
    else:
        source = statement.module or ""
    for alias in statement.names:
        candidate = f"{source}.{alias.name}"
        yield candidate if candidate in known else source


def import_graph(root: Path = ROOT, *, top_level_only: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports (all of them, or only those at module level)."""
    files = module_files(root)
    known = set(files)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for statement, top in _imports(tree):
            if top_level_only and not top:
                continue
            for target in _targets(statement, name, path.name == "__init__.py", known):
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: strongly connected components of two or more modules (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative Tarjan: the graph is deep enough for Python's recursion limit
        nonlocal counter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...]) -> int:
    """The index in ``layers`` of the layer holding ``module`` (the longest matching prefix wins)."""
    best, best_length = 0, -1
    for number, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = number, len(prefix)
    return best


def upward_arrows(graph: dict[str, set[str]], layers: tuple[tuple[str, tuple[str, ...]], ...]) -> list[tuple[str, str]]:
    """Imports from a lower layer to a higher one, sorted."""
    return sorted((source, target) for source, targets in graph.items() for target in targets
                  if layer_of(target, layers) > layer_of(source, layers))


def main() -> int:
    graph, layers = import_graph(), read_layers()
    circles, arrows = cycles(graph), upward_arrows(graph, layers)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, "
          f"{len(circles)} circles, {len(arrows)} arrows against the layering")
    for circle in circles:
        print("circle:", " <-> ".join(circle))
    for source, target in arrows:
        print(f"upward: {source} ({layers[layer_of(source, layers)][0]}) -> {target} "
              f"({layers[layer_of(target, layers)][0]})")
    return 1 if circles or arrows else 0


if __name__ == "__main__":
    sys.exit(main())
