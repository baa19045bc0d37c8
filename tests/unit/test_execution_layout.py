"""The execution package's shape: the executor calls one queue interface and knows neither
implementation; no two of its modules import each other, not even through a local import."""

from __future__ import annotations

import ast
from pathlib import Path

import buildvault.execution.executor as executor_module

ROOT = Path(executor_module.__file__).resolve().parent  # src/buildvault/execution
PACKAGE = "buildvault.execution"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _imports(path: Path) -> set[str]:
    """Every execution module `path` imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from buildvault.execution.redis import keys` imports the module `...redis.keys`.
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith(PACKAGE + ".") or name == PACKAGE}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in ROOT.rglob("*.py")}
    return {name: _imports(path) & set(modules) for name, path in modules.items()}


def test_the_graph_sees_the_modules_it_checks():
    graph = _graph()
    assert f"{PACKAGE}.redis.queue" in graph[f"{PACKAGE}.runtime"]
    assert f"{PACKAGE}.local.queue" in graph[f"{PACKAGE}.runtime"]
    assert f"{PACKAGE}.redis.keys" in graph[f"{PACKAGE}.redis.state"]


def test_the_executor_knows_only_the_queue_interface():
    imported = _graph()[f"{PACKAGE}.executor"]
    assert f"{PACKAGE}.queue" in imported
    assert not {name for name in imported if name.startswith((f"{PACKAGE}.local", f"{PACKAGE}.redis"))}


def test_neither_queue_imports_the_other_or_the_executor():
    for name, imported in _graph().items():
        for this, other in (("local", "redis"), ("redis", "local")):
            if name.startswith(f"{PACKAGE}.{this}"):
                assert not {i for i in imported if i.startswith(f"{PACKAGE}.{other}")}, name
                assert f"{PACKAGE}.executor" not in imported, name


def test_no_two_execution_modules_import_each_other():
    graph = _graph()
    pairs = {tuple(sorted((a, b))) for a, imported in graph.items() for b in imported if a in graph.get(b, set())}
    assert pairs == set()
