"""The modules of `infer` import one another without a cycle, and never `transformers` or `reference`.

Read from the source with `ast`, not by importing it: an import inside a function counts as much as one at the
top of the module, since a cycle through a function-level import is the same tangle, only found later (at the
call). The package `infer` itself (its `__init__.py` re-exports) is not a node: importing it is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "infer"
FORBIDDEN = ("transformers", "reference")


def module_name(path: Path) -> str:
    """`infer/cache/paged.py` -> `infer.cache.paged`; `infer/cache/__init__.py` -> `infer.cache`."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The module of `infer` that importing `name` runs, or None for the package `infer` itself (not an edge)."""
    while name not in MODULES:  # `infer.x.y` where y is a name in infer.x, not a module
        name = name.rpartition(".")[0]
    return None if name == "infer" else name


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(the `infer` modules `path` imports, anywhere in it; every top-level package it imports)."""
    edges: set[str] = set()
    tops: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..cache import y`
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from infer.pkg import x` runs infer.pkg.x when x is a module, else only infer.pkg.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            tops.add(target.split(".")[0])
            if target.split(".")[0] == "infer":
                resolved = _resolve(target)
                if resolved is not None:
                    edges.add(resolved)
    return edges, tops


def import_graph() -> dict[str, set[str]]:
    """Every module of `infer` (but the package itself) -> the `infer` modules it imports."""
    return {name: imports_of(path)[0] - {name} for name, path in MODULES.items() if name != "infer"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None: a depth-first search that meets a module still on its path."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return [*path[path.index(nxt):], nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return None


def test_the_graph_sees_the_imports_it_should() -> None:
    # Guards the test itself: a parser that found no edges would find no cycle either.
    graph = import_graph()
    assert "infer.cli_args" in graph["infer.__main__"]
    assert "infer.cli_args" in graph["infer.bench"]
    assert "infer.bench" in graph["infer.__main__"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_inside_infer() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_infer_never_imports_transformers_or_reference() -> None:
    bad = {name: sorted(tops & set(FORBIDDEN)) for name, path in MODULES.items()
           if (tops := imports_of(path)[1]) & set(FORBIDDEN)}
    assert not bad, f"modules of infer importing {FORBIDDEN}: {bad}"
