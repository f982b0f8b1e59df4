"""The package's written import rule, enforced: lower layers never import upper ones."""

from __future__ import annotations

import ast
from pathlib import Path

import relaygr.kvcache

LAYERS = {"integrity": 0, "pools": 0, "sizing": 1, "allocator": 1, "index": 2,
          "store": 3, "transfer": 3, "device": 3, "host": 3, "expander": 3}
# Outside the package, the cache may use only what sits beneath all of it.
ALLOWED_OUTSIDE = {"relaygr.model", "relaygr.errors"}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("relaygr")}


def test_every_module_has_a_layer_and_imports_only_downwards() -> None:
    package = Path(relaygr.kvcache.__file__).parent
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    assert modules == set(LAYERS)
    for name in sorted(modules):
        for imported in imports_of(package / f"{name}.py"):
            if imported.startswith("relaygr.kvcache."):
                target = imported.removeprefix("relaygr.kvcache.")
                assert LAYERS[target] <= LAYERS[name], f"{name} imports upper layer {target}"
                assert target != name
            else:
                assert imported in ALLOWED_OUTSIDE, f"{name} imports {imported}"
