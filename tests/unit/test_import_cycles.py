"""No import cycles among the modules of ``deep_ep_npu`` and ``server``.

The graph is built from the source (``ast``), so it sees every import: at module level, inside functions (lazy
imports) and under ``if TYPE_CHECKING:``. An edge goes to the module an import names: ``from .x import y`` is an edge
to ``x.y`` when that is a module, else to ``x`` (a package's ``__init__``). Parent packages that Python runs on the
way are not edges: a module may import its siblings through their package without that counting as a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("deep_ep_npu", "server")


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the packages (a package is its ``__init__.py``)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (None: not ours)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that ``module`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            names = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem for alias in node.names]
        else:
            continue
        targets.update(t for t in (_resolve(n, known) for n in names) if t is not None and t != module)
    return targets


def graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imports_of(module, path, known) for module, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan, then a shortest loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
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
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_shortest_loop(c, edges) for c in components]


def describe(loop: list[str], edges: dict[str, set[str]]) -> str:
    return " -> ".join(loop)


def _shortest_loop(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest cycle through the component's first module, by breadth-first search inside the component."""
    start, inside = component[0], set(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no loop through {start} in {component}")


def test_the_graph_sees_lazy_and_type_checking_imports():
    """The checker itself: a cycle closed only by a function-level import, or only under TYPE_CHECKING, is found."""
    lazy = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert cycles(lazy) == [["a", "b", "a"]]
    known = modules()
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import envs\n\ndef f():\n    import server\n"
    )
    path = ROOT / "deep_ep_npu" / "_cycle_probe.py"
    try:
        path.write_text(source, encoding="utf-8")
        assert imports_of("deep_ep_npu._cycle_probe", path, {**known, "deep_ep_npu._cycle_probe": path}) == {
            "deep_ep_npu.envs",
            "server",
        }
    finally:
        path.unlink()


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(" -> ".join(c) for c in found)
