"""The event log behind the HTTP API: a write SQLite refuses is a short 503 that stalls nobody
else, counted, and makes the server not ready until a write succeeds again."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace
from pathlib import Path

import httpx

from relaygr.cascade.eventlog import APPEND_BUSY_TIMEOUT_S
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.server import ServerConfig, build_embedded
from relaygr.server.build import load_model
from tests.engine.helpers import flops_cost_model
from tests.server.helpers import SOURCE, run_with_client, system_config, until

T0 = 1_900_000_000          # after every synthetic event


def _failures(metrics: str) -> float:
    line = next(x for x in metrics.splitlines()
                if x.startswith("relaygr_event_log_write_failures_total "))
    return float(line.split()[1])


def test_a_refused_log_write_is_a_short_503_and_the_server_not_ready_until_one_succeeds(
        tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    source = replace(SOURCE, events=path)
    service = build_embedded(source, system_config(), ServerConfig(),
                             flops_cost_model(load_model(source).cfg))
    store = service.backend.store

    def events(item: int, t: int) -> dict[str, object]:
        return {"user_id": 1, "items": [item], "timestamps": [t]}

    async def body(client: httpx.AsyncClient) -> None:
        assert (await client.post("/v1/events", json=events(5, T0))).status_code == 200
        before = store.get(1)
        blocker = sqlite3.connect(path, timeout=0, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")      # another program holds the write lock

        refused = await client.post("/v1/events", json=events(6, T0 + 1))
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "HistoryStoreUnavailableError"
        assert refused.headers["Retry-After"] == "1"
        # how long an append waits for the lock, every request with it (the loop's thread):
        # the log's short timeout, not SQLite's 5 s (read from the connection, not timed)
        assert isinstance(store, InMemoryHistoryStore)
        log = store._events
        assert log is not None
        waited_ms = log._db.execute("PRAGMA busy_timeout").fetchone()[0]
        assert waited_ms == round(APPEND_BUSY_TIMEOUT_S * 1000) < 5000
        assert (await client.get("/healthz")).status_code == 200
        after = store.get(1)                    # nothing of the refused append is held
        assert after.items.tolist() == before.items.tolist()
        assert after.version == before.version
        ready = await client.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert ready.json()["history_store"] is False
        assert str(path) in ready.json()["history_store_error"]
        assert _failures((await client.get("/metrics")).text) == 1.0
        assert (await client.get("/readyz")).status_code == 503      # its probe refused too
        blocker.execute("ROLLBACK")
        blocker.close()
        ready = await client.get("/readyz")     # the probe write succeeds: ready, no traffic
        assert ready.status_code == 200, ready.text
        assert ready.json()["history_store_error"] is None
        again = await client.post("/v1/events", json=events(6, T0 + 1))   # the retry
        assert again.status_code == 200 and again.json()["num_events"] == before.num_events + 1
        assert _failures((await client.get("/metrics")).text) == 1.0  # probes are not counted

    run_with_client(service, body)


def test_an_append_that_outlives_a_timed_out_drain_is_refused_not_acknowledged(
        tmp_path: Path) -> None:
    """Shutdown closes the store (and its event log) once the drain times out; a request still
    in flight then appends. It must be a 503, not a 200 for events a restart would not have."""
    path = tmp_path / "events.sqlite"
    source = replace(SOURCE, events=path)
    cost = flops_cost_model(load_model(source).cfg)
    service = build_embedded(source, system_config(), ServerConfig(drain_timeout_s=0.05), cost)

    async def body(client: httpx.AsyncClient) -> httpx.Response:
        async with service.users.hold(1):    # the append waits here, admitted, past the drain
            late = asyncio.ensure_future(client.post(
                "/v1/events", json={"user_id": 1, "items": [5], "timestamps": [T0]}))
            await until(lambda: service.admission.in_flight == 1)
            await service.stop()              # the drain times out: the store is closed
        return await late

    answer = run_with_client(service, body)
    assert not service.lifecycle.drained_cleanly
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"] == "HistoryStoreUnavailableError"
    restarted = build_embedded(source, system_config(), ServerConfig(), cost)
    assert restarted.backend.store.num_events(1) == service.backend.store.num_events(1)
    restarted.backend.store.close()
