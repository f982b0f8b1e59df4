"""``serve --history-store redis://``: servers share the users' histories, a restart keeps every
acknowledged event, a second server adds nothing twice, and a store out of reach is a 503."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from relaygr.cascade.redis_store import RedisHistoryStore
from relaygr.cli import serve
from relaygr.errors import ConfigError
from relaygr.server import RelayService, ServerConfig, build_embedded
from relaygr.server.build import load_model
from tests.engine.helpers import flops_cost_model
from tests.redis_server import RedisServer
from tests.server.helpers import SOURCE, run_with_client, system_config

T0 = 1_900_000_000          # after every synthetic event


def _service(url: str) -> RelayService:
    source = replace(SOURCE, history_store=url)
    return build_embedded(source, system_config(), ServerConfig(),
                          flops_cost_model(load_model(source).cfg))


def _events(user: int, items: list[int], t: int) -> dict[str, object]:
    return {"user_id": user, "items": items, "timestamps": [t] * len(items)}


def test_servers_share_histories_and_a_restart_keeps_every_acknowledged_event(
        redis_url: str) -> None:
    first = _service(redis_url)
    store = first.backend.store
    assert isinstance(store, RedisHistoryStore) and len(store) == SOURCE.num_users
    base = {u: store.get(u).items.tolist() for u in store}

    async def write(client: httpx.AsyncClient) -> list[int]:
        counts = []
        for user, t in ((1, T0), (2, T0), (40, T0)):             # 40: a new user
            r = await client.post("/v1/events", json=_events(user, [5, 6, 7], t))
            assert r.status_code == 200, r.text
            counts.append(r.json()["num_events"])
        r = await client.post("/v1/recommend", json={
            "user_id": 1, "recent_items": [9], "recent_timestamps": [T0 + 10],
            "request_ts": T0 + 20})
        assert r.status_code == 200, r.text
        return counts

    counts = run_with_client(first, write)
    second = _service(redis_url)                   # a restart, or another server beside it
    shared = second.backend.store
    assert len(shared) == SOURCE.num_users + 1     # the dataset's users were not added again
    assert shared.get(1).items.tolist() == base[1] + [5, 6, 7, 9]
    assert shared.get(2).items.tolist() == base[2] + [5, 6, 7]
    assert shared.get(40).items.tolist() == [5, 6, 7] and counts[2] == 3
    assert shared.get(3).items.tolist() == base[3]

    async def append_on_second(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/events", json=_events(2, [8], T0 + 30))
        assert r.status_code == 200 and r.json()["num_events"] == len(base[2]) + 4

    run_with_client(second, append_on_second)
    assert store.get(2).items.tolist() == base[2] + [5, 6, 7, 8]       # the first server sees it
    assert store.version_at(2, len(base[2]) + 4) == shared.get(2).version
    shared.check_integrity()  # type: ignore[attr-defined]


def test_a_retried_append_with_its_precondition_is_refused_by_the_shared_store(
        redis_url: str) -> None:
    """The retry reaches another server over the same store: the store's count decides."""
    first, second = _service(redis_url), _service(redis_url)
    n = first.backend.store.num_events(1)
    append = {**_events(1, [5, 6], T0), "expected_events": n}

    async def send(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/events", json=append)

    assert run_with_client(first, send).status_code == 200
    retry = run_with_client(second, send)
    assert retry.status_code == 409, retry.text
    assert retry.json()["error"] == "HistoryConflictError"
    assert retry.json()["num_events"] == n + 2
    assert second.backend.store.num_events(1) == n + 2


def test_a_store_out_of_reach_answers_503_and_the_server_keeps_serving(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    service = _service(server.url)

    async def body(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/events", json=_events(1, [5], T0))
        assert r.status_code == 200, r.text
        assert (await client.get("/readyz")).json()["history_store"] is True
        server.stop()
        for path, payload in (("/v1/events", _events(1, [6], T0)),
                              ("/v1/recommend", {"user_id": 1})):
            r = await client.post(path, json=payload)
            assert r.status_code == 503, r.text
            assert r.json()["error"] == "HistoryStoreUnavailableError"
            assert r.headers["Retry-After"] == "1"
        assert (await client.get("/healthz")).status_code == 200
        ready = await client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["history_store"] is False
        assert server.url in ready.json()["history_store_error"]

    run_with_client(service, body)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", "--size", "tiny", *argv])


def test_the_history_store_flag_names_the_store_and_replaces_the_event_log(
        tmp_path: Path) -> None:
    options = serve.options_from_args(_parse("--history-store", "redis://127.0.0.1:6379/1"))
    assert options.model.history_store == "redis://127.0.0.1:6379/1"
    assert options.model.events is None
    assert serve.options_from_args(_parse()).model.history_store is None
    run = tmp_path / "run"
    auto = serve.options_from_args(_parse("--checkpoint", str(run), "--synthetic-users",
                                          "--history-store", "redis://h:1"))
    assert auto.model.events is None                 # no SQLite log beside a shared store
    with pytest.raises(ConfigError, match="--history-store or --events"):
        serve.options_from_args(_parse("--history-store", "redis://h:1", "--events",
                                       str(tmp_path / "e.sqlite")))
    with pytest.raises(ConfigError, match="redis://HOST:PORT"):
        serve.options_from_args(_parse("--history-store", "localhost:6379"))


def test_more_than_one_ingress_replica_needs_the_shared_store() -> None:
    options = serve.options_from_args(_parse("--ray", "--ingress-replicas", "2",
                                             "--history-store", "redis://h:1"))
    assert options.ingress_replicas == 2 and options.model.history_store == "redis://h:1"
    with pytest.raises(ConfigError, match="2 ingress replicas need a shared history store"):
        serve.options_from_args(_parse("--ray", "--ingress-replicas", "2"))
    with pytest.raises(ConfigError, match="--ingress-replicas is for --ray"):
        serve.options_from_args(_parse("--ingress-replicas", "2", "--history-store",
                                       "redis://h:1"))
    with pytest.raises(ConfigError, match="must be an int >= 1"):
        serve.options_from_args(_parse("--ray", "--ingress-replicas", "0"))
