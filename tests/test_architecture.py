"""The layering of docs/architecture.md, checked: no upward or sideways import, no circle.

Read from the source (every ``import`` and ``from ... import`` of ``relaygr``, those under
``TYPE_CHECKING`` too: a circle a type checker must untangle is one a reader must untangle), so
the rule holds whether or not a module happens to be imported by the suite.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. A package may import itself and the packages of lower layers, nothing else.
# (The root ``relaygr`` package holds only the version.)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("relaygr", "errors", "files", "splitmix", "timing", "wake"),
    ("settings",),
    ("model", "data", "routing", "retrieval"),
    ("kvcache", "relay", "train"),
    ("engine",),
    ("cascade",),
    ("bench", "server"),
    ("distributed",),
    ("cli",),
    ("__main__",),
)
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (SRC / "relaygr").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(path: Path) -> set[str]:
    """Every ``relaygr`` module name ``path`` imports (``from a import b`` counts ``a.b`` too:
    it may be a submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "relaygr":
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "relaygr")
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (names resolved to the module that defines them)."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        graph[mod]
        for name in _imports(path):
            while name not in mods:
                name = name.rpartition(".")[0]
            if name != mod:
                graph[mod].add(name)
    return graph


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                    circles.append(sorted(component))
    return circles


def test_every_package_has_a_layer() -> None:
    packages = {_package(mod) for mod in _modules()}
    assert packages - set(LAYER_OF) == set(), "add the new package to LAYERS and the docs"


def test_no_import_goes_up_or_sideways() -> None:
    wrong = []
    for mod, targets in _graph().items():
        mine = _package(mod)
        for target in targets:
            theirs = _package(target)
            if theirs != mine and LAYER_OF[theirs] >= LAYER_OF[mine]:
                wrong.append(f"{mod} -> {target}")
    assert wrong == []


def test_no_import_circles() -> None:
    assert _circles(_graph()) == []


def test_the_checker_sees_a_circle_and_an_upward_import() -> None:
    # the checks above must be able to fail
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert LAYER_OF["bench"] > LAYER_OF["relay"]       # so relay -> bench would be reported
