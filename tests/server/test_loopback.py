"""The real server on loopback (uvicorn in a child process): graceful shutdown drains requests."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from relaygr.server import ServerConfig
from relaygr.server.build import load_model
from relaygr.server.loopback import LoopbackServer, LoopbackSpec
from tests.engine.helpers import flops_cost_model
from tests.server.helpers import SOURCE, system_config

pytestmark = pytest.mark.slow


def test_sigterm_style_exit_drains_in_flight_requests() -> None:
    cost = flops_cost_model(load_model(SOURCE).cfg).to_dict()
    # a 5 s retrieval stage: the request is surely in flight while the test looks
    spec = LoopbackSpec(SOURCE, system_config(stages={"retrieval_delay_ms": 5000}),
                        ServerConfig(port=0, drain_timeout_s=10), cost, 1)
    server = LoopbackServer(spec)
    answers: list[httpx.Response] = []
    try:
        assert httpx.get(f"{server.url}/readyz").json()["ready"] is True
        worker = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{server.url}/v1/recommend", json={"user_id": 2}, timeout=30)))
        worker.start()
        deadline = time.monotonic() + 60      # a hang guard, not a verdict
        while server.report().in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.report().in_flight == 1  # inside its retrieval stage
    finally:
        code = server.close()
    worker.join()
    assert code == 0
    assert answers[0].status_code == 200, answers[0].text      # drained, not dropped
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/healthz")


def test_report_after_load_is_clean() -> None:
    cost = flops_cost_model(load_model(SOURCE).cfg).to_dict()
    with LoopbackServer(LoopbackSpec(SOURCE, system_config(), ServerConfig(port=0), cost,
                                     1)) as server, httpx.Client(base_url=server.url) as client:
        for user in range(1, 9):
            assert client.post("/v1/recommend", json={"user_id": user}).status_code == 200
        server.fail("rank-0")
        assert client.post("/v1/recommend", json={"user_id": 3}).json()["instance"] == "rank-1"
        server.restart("rank-0")
        report = server.report()
    assert report.integrity_error is None and report.pinned_entries == 0
    assert report.counters.requests == 9 and report.in_flight == 0
    assert report.rss_bytes > 0
