"""The package has no import cycles, and importing it loads no torch until a model is used.

The import graph is read from the source: every ``import`` and ``from ... import`` of an
``ecp_lm`` module, at module level or inside a function (a deferred import is still a
dependency), except those under ``if TYPE_CHECKING:`` (annotations only, never executed).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ecp_lm"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if f"{base}.{alias.name}" in MODULES)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in MODULES and name != module}


def import_graph() -> dict[str, set[str]]:
    return {name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py")
            for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_deferred_imports_and_skips_type_checking_ones():
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from ecp_lm.config import ModelConfig\n"
              "def f():\n    from ecp_lm.model import model\n")
    found = _imports(ast.parse(source), "ecp_lm.fsutil", False)
    assert found == {"ecp_lm.model", "ecp_lm.model.model"}


def test_there_are_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and graph["ecp_lm.model.model"]  # the graph was read
    assert cycles(graph) == []


def test_every_module_imports_first_in_a_fresh_interpreter_state():
    # Each module imported first, with every ecp_lm module unloaded before it: an import-time
    # cycle shows as an ImportError of a partially initialised module.
    script = (
        "import importlib, sys\n"
        f"names = {sorted(n for n in MODULES if not n.endswith('__main__'))!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'ecp_lm' or m.startswith('ecp_lm.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as err:\n"
        "        failed.append(f'{name}: {err}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_importing_the_package_its_config_and_its_cli_loads_no_torch():
    script = ("import sys\nimport ecp_lm, ecp_lm.config, ecp_lm.cli\n"
              "from ecp_lm import ModelConfig, PRESETS, ARCHS\n"
              "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
