"""Distributed tests need Ray Serve (the ``ray`` extra); without it they are not collected.

Tests that start a local Ray cluster are marked ``ray`` (and ``slow``).
"""

from __future__ import annotations

import warnings

import pytest

try:
    # Ray Serve's own pydantic models warn when first imported; they are not ours to fix.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import ray.serve  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: starts a local Ray cluster (run with -m ray)")
