"""How the package is put together: no module of wmo_trio imports itself back, however
indirectly, at import time or inside a function (issue 16: one job per module, layered);
and the modules that run under another interpreter keep to what it offers."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "wmo_trio"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ancestors(module: str) -> list[str]:
    """The packages a module is in, outermost first: `a.b.c` -> `a`, `a.b`."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _lazy_names(tree: ast.Module, modules: set[str]) -> dict[str, str]:
    """A package's names resolved on first access (a module `__getattr__` that imports
    them): name -> module, from its module-level table of them."""
    if not any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
               for node in tree.body):
        return {}
    names: dict[str, str] = {}
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if isinstance(value, ast.Dict):
            for key, target in zip(value.keys, value.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(target, ast.Constant) \
                        and target.value in modules:
                    names[key.value] = target.value
    return names


def _imported_by_name(tree: ast.Module, modules: set[str]) -> set[str]:
    """What a module imports at run time by name (`importlib.import_module`): the wmo_trio
    modules its strings name, alone or as `module:attribute`."""
    if not any(isinstance(node, ast.Attribute) and node.attr == "import_module"
               for node in ast.walk(tree)):
        return set()
    return {node.value.partition(":")[0] for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.partition(":")[0] in modules}


# Read once per process: each reading parses every module of the package.
@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Every wmo_trio module and the wmo_trio modules it imports, wherever the import
    stands (module level, function body, TYPE_CHECKING blocks excepted), `wmo_trio`'s own
    `__init__` included:

    - importing `a.b.c` runs the packages `a` and `a.b` first, so those are imported too,
      except the importer's own packages: they are already running when it runs (a
      package's `__init__` that imports its submodules, which import each other by
      absolute name, is no cycle; an explicit import of a name from one's own package
      still counts);
    - a module that imports by name (`importlib.import_module`) imports what it names;
    - a package's lazy names (its `__getattr__`) are imported by whoever asks for one,
      `from package import name` or `package.name`: the package's own code imports them
      only on that request.
    """
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in paths.items()}
    lazy = {name: _lazy_names(tree, modules) for name, tree in trees.items()}
    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
        package = name if paths[name].name == "__init__.py" else name.rpartition(".")[0]
        targets = _imported_by_name(tree, modules) - set(lazy[name].values())
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.add(submodule if submodule in modules else base)
                    targets.update(n for n in [lazy.get(base, {}).get(alias.name)] if n)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.attr in lazy.get(node.value.id, {}):
                targets.add(lazy[node.value.id][node.attr])
        own = {name, *_ancestors(name)}
        targets |= {outer for target in targets for outer in _ancestors(target)} - own
        graph[name] = {target for target in targets if target in modules} - {name}
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


def test_the_import_graph_counts_packages_run_on_the_way_and_imports_by_name() -> None:
    graph = import_graph()
    # research's pool imports wmo_trio.episode.environment, which runs wmo_trio.episode first
    assert "wmo_trio.episode" in graph["wmo_trio.research._pool"]
    # a submodule's own package is already running: no edge back to it
    assert "wmo_trio.episode" not in graph["wmo_trio.episode.runtime"]
    # provider classes are imported by name, when a provider is built
    assert "wmo_trio.providers.scripted" in graph["wmo_trio.providers"]
    # the package's lazy names import their modules for whoever asks for them, not for all
    assert {"wmo_trio.research", "wmo_trio.harness", "wmo_trio.models"}.isdisjoint(
        graph["wmo_trio"])
    assert "wmo_trio" in graph["wmo_trio.harbor._agent"]  # its __version__, not lazy


def test_no_module_of_wmo_trio_imports_itself_back() -> None:
    assert cycles(import_graph()) == []


def layers(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between the package's parts (`wmo_trio`'s own `__init__`,
    `wmo_trio.episode`, `wmo_trio.control`, ...): which part uses which."""
    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    parts: dict[str, set[str]] = {part(m): set() for m in graph}
    for module, targets in graph.items():
        parts[part(module)].update(part(t) for t in targets if part(t) != part(module))
    return parts


def test_the_parts_of_wmo_trio_are_layered() -> None:
    # e.g. the episode never imports a backend that imports the episode back
    assert cycles(layers(import_graph())) == []


# Modules shipped to run under an interpreter other than this one, with the oldest Python
# each promises (its docstring says why): only that syntax, only the standard library.
SHIPPED = {
    "episode/portable.py": (3, 8),  # the e2b runner, under the sandbox's python3
    "sandbox/_helper.py": (3, 9),  # the sandbox's PID 1, under the image's python3 -I -S
}


def standard_library_only(source: str, floor: tuple[int, int]) -> set[str]:
    """The top-level modules `source` imports, once it parses as Python `floor`."""
    tree = ast.parse(source, feature_version=floor)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    return imported


@pytest.mark.parametrize("module", list(SHIPPED))
def test_shipped_modules_keep_to_their_python_floor_and_the_standard_library(module: str) -> None:
    imported = standard_library_only((PACKAGE / module).read_text(encoding="utf-8"), SHIPPED[module])
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


def test_the_floor_check_refuses_newer_syntax_and_other_packages() -> None:
    with pytest.raises(SyntaxError):
        standard_library_only("match x:\n    case 1:\n        pass\n", (3, 9))
    assert standard_library_only("import json\nfrom trio import run\n", (3, 9)) == {"json", "trio"}


# What a process that loads the harbor agent and environment (every `harbor run` of them)
# or runs `wmo-trio`'s command line must not import before a trial runs: each costs from a
# tenth of a second to seconds of CPU, paid by every such process, and `trio_asyncio`
# changes asyncio's loop policy for the whole process.
HEAVY = ("anthropic", "openai", "e2b", "numpy", "scipy", "matplotlib", "litellm", "trio_asyncio",
         "ray")
# wmo_trio's own modules that bring them, or that only some trials use.
HEAVY_OWN = ("wmo_trio.compare", "wmo_trio.backends.e2b", "wmo_trio.backends._sandbox",
             "wmo_trio.providers.anthropic", "wmo_trio.providers.openai", "wmo_trio.research",
             "wmo_trio.cluster")

_LOAD_PROBE = """
import importlib, json, sys

def load(path):
    module, _, name = path.partition(":")  # as harbor resolves an import path
    return getattr(importlib.import_module(module), name)

def loaded(prefixes):
    return sorted(m for m in sys.modules
                  if any(m == p or m.startswith(p + ".") for p in prefixes))

found = {}
load("wmo_trio.harbor:WmoTrioHarborAgent")
found["agent alone: the sandbox"] = loaded(["wmo_trio.sandbox"])
load("wmo_trio.harbor:LocalEnvironment")
import wmo_trio.cli
found["agent, environment and command line: heavy"] = loaded(sys.argv[1].split(","))
print(json.dumps(found))
"""


def test_loading_the_agent_the_environment_and_the_cli_imports_nothing_heavy() -> None:
    # Not marked slow: this one child interpreter guards what every harbor run imports.
    completed = subprocess.run(
        [sys.executable, "-c", _LOAD_PROBE, ",".join(HEAVY + HEAVY_OWN)],
        capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == {
        "agent alone: the sandbox": [],
        "agent, environment and command line: heavy": [],
    }
