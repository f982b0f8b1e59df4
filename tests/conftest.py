"""Shared fixtures: deterministic small models and generated histories."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests.redis_server import RedisServer

# Tests must behave the same on a 2-core CI runner and a workstation; RELAYGR_TEST_THREADS
# runs the suite at another thread count (its results must not change: nothing in it depends
# on speed, and tolerances cover any reduction order, tests/tolerance.py).
torch.set_num_threads(int(os.environ.get("RELAYGR_TEST_THREADS", min(2, os.cpu_count() or 1))))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A ``redis-server`` for the session (skips without one, see tests/redis_server.py)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied for this test."""
    redis_server.flush()
    return redis_server.url
