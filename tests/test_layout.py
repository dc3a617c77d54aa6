"""How the package is put together: no module of wmo_trio imports itself back, however
indirectly, at import time or inside a function (issue 16: one job per module, layered)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "wmo_trio"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every wmo_trio module and the wmo_trio modules it imports, wherever the import
    statement stands (module level, function body, TYPE_CHECKING blocks excepted)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                found.append([*stack[stack.index(target):], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_import_graph_finds_the_modules_and_their_imports() -> None:
    graph = import_graph()
    assert "wmo_trio.engine._engine" in graph["wmo_trio.engine"]
    assert "wmo_trio.control" in graph["wmo_trio.episode.runtime"]
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


def test_no_module_of_wmo_trio_imports_itself_back() -> None:
    assert cycles(import_graph()) == []


def layers(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between the package's parts (`wmo_trio.episode`, `wmo_trio.control`,
    ...): which part uses which. The package's own `__init__` (its version, lazy names)
    is left out."""
    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    parts: dict[str, set[str]] = {part(m): set() for m in graph if m != "wmo_trio"}
    for module, targets in graph.items():
        if module == "wmo_trio":
            continue
        parts[part(module)].update(part(t) for t in targets if t != "wmo_trio" and part(t) != part(module))
    return parts


def test_the_parts_of_wmo_trio_are_layered() -> None:
    # e.g. the episode never imports a backend that imports the episode back
    assert cycles(layers(import_graph())) == []
