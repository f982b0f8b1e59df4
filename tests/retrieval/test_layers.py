"""The retrieval package sits beside the model and the relay: it imports only the bottom layer
(``relaygr.errors``, ``relaygr.files``, ``relaygr.settings``, ``relaygr.timing``), itself and
third-party packages."""

from __future__ import annotations

import ast
from pathlib import Path

import relaygr.retrieval

PACKAGE = Path(relaygr.retrieval.__file__).parent


def _relaygr_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("relaygr")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("relaygr"):
            out.add(node.module)
    return out


BOTTOM_LAYER = {"relaygr.errors", "relaygr.files", "relaygr.settings", "relaygr.timing"}


def test_retrieval_imports_only_the_bottom_layer_and_itself() -> None:
    modules = sorted(PACKAGE.glob("*.py"))
    assert len(modules) >= 10
    for path in modules:
        for name in _relaygr_imports(path):
            assert name in BOTTOM_LAYER or name.startswith("relaygr.retrieval"), \
                f"{path.name} imports {name}"
