"""Integrity-check helper shared by every cache layer (it imports nothing from the package).

``check_integrity()`` methods verify accounting that tests call after every operation; they must
raise even under ``python -O``, where ``assert`` statements vanish, hence ``require``.
"""

from __future__ import annotations


def require(condition: bool, message: str) -> None:
    """Raise ``AssertionError(message)`` unless ``condition`` holds."""
    if not condition:
        raise AssertionError(message)
