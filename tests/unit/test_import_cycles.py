"""No two modules of buildvault import each other, directly or round a longer loop, counting every
import statement: at the top, inside a function, or under TYPE_CHECKING (a loop of modules is one
concern split in two, or a callback that should be a parameter)."""

from __future__ import annotations

import ast
from pathlib import Path

import buildvault

SRC = Path(buildvault.__file__).parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in SRC.rglob("*.py"):
        parts = ("buildvault", *path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The buildvault modules `name` imports (a package's own __init__ counts as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    found.add(target)  # a module of the package
                elif base in modules:
                    found.add(base)  # a name defined in the module (or the package's __init__)
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_the_graph_sees_the_imports_it_must_see() -> None:
    graph = import_graph()
    assert "buildvault.storage.disk.core" in graph["buildvault.storage.disk.writes"]  # from ... import Core
    assert "buildvault.storage.disk.fileops" in graph["buildvault.storage.disk.writes"]  # from package import module
    assert "buildvault.storage" in graph["buildvault.storage.disk.core"]  # a name of a package's __init__


def test_the_graph_covers_the_newer_packages_and_their_local_imports() -> None:
    graph = import_graph()
    # One module of each package this round added, with an import it makes (local ones included).
    assert "buildvault.assets.request" in graph["buildvault.assets.service"]
    assert "buildvault.assets.service" in graph["buildvault.assets"]  # inside build_assets()
    assert "buildvault.history.store" in graph["buildvault.history.recorder"]
    assert "buildvault.storage.chunks.chunker" in graph["buildvault.storage.chunks.store"]
    assert "buildvault.server.auth.credentials" in graph["buildvault.server.auth.oidc"]
    assert "buildvault.pins" in graph["buildvault.server.auth.audit"]  # inside a function
    assert "buildvault.client.ci_token" in graph["buildvault.server.auth.tokens"]  # inside a function


def test_the_cycle_finder_finds_loops_of_any_length() -> None:
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_modules_import_each_other() -> None:
    assert cycles(import_graph()) == []
