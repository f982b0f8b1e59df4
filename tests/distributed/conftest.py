"""Ray tests are marked ``ray`` (and ``slow``: they start a local Ray cluster)."""

from __future__ import annotations

import warnings

import pytest

# Ray Serve's own pydantic models warn when first imported; they are not ours to fix.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import ray.serve  # noqa: F401


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: starts a local Ray cluster (run with -m ray)")
