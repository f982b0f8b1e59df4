"""Overload sheds pre-infer first, then answers ranking 503 + Retry-After; shutdown drains."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from relaygr.errors import ConfigError
from relaygr.server import ServerConfig
from relaygr.server.admission import DoorRefusal
from tests.server.helpers import (
    held_compute,
    make_service,
    run_with_client,
    system_config,
    until,
)


def test_ranking_overload_answers_503_with_retry_after() -> None:
    # One queued ranking request is the limit, and batches take one request. With the
    # instances' compute held, each instance has one batch in compute and one request queued:
    # 24 rankings over 2 instances must shed some (at least one instance gets three or more).
    service = make_service(system_config(overload={"max_rank_queue_depth": 1},
                                         instance={"batch": {"max_requests": 1}},
                                         slo_ms=250.0))
    counters = lambda: service.backend.snapshot().counters  # noqa: E731

    async def body(client: httpx.AsyncClient) -> list[httpx.Response]:
        async with held_compute(service):
            burst = [asyncio.ensure_future(client.post("/v1/rank", json={
                "user_id": 1 + i % 20, "candidates": list(range(1, 200))})) for i in range(24)]
            await until(lambda: counters().shed_rank > 0)
        return list(await asyncio.gather(*burst))

    answers = run_with_client(service, body)
    shed = [r for r in answers if r.status_code == 503]
    served = [r for r in answers if r.status_code == 200]
    assert len(shed) + len(served) == 24
    assert shed and served
    for r in shed:
        assert r.headers["retry-after"] == "1"          # ceil(slo_ms 250 ms)
        assert r.json()["error"] == "OverloadedError"
        assert "ranking requests queued" in r.json()["detail"]
    assert counters().shed_rank == len(shed)
    assert counters().requests == len(served)


def test_preinfer_is_shed_before_ranking() -> None:
    service = make_service(system_config(overload={"shed_preinfer_queue_depth": 1,
                                                   "max_rank_queue_depth": 64},
                                         instance={"batch": {"max_requests": 1}}))
    system = service.backend.system  # type: ignore[attr-defined]
    counters = lambda: service.backend.snapshot().counters  # noqa: E731

    async def body(client: httpx.AsyncClient) -> list[httpx.Response]:
        async with held_compute(service):
            # A queue of ranking work first (each instance: one batch held in compute, the
            # rest queued), then visits of other users (a user's requests are served in order)
            # whose pre-infer signals arrive behind it.
            ranks = [asyncio.ensure_future(client.post("/v1/rank", json={
                "user_id": 1 + i, "candidates": list(range(1, 400))})) for i in range(16)]
            await until(lambda: sum(i.rank_queue_depth for i in system.instances) >= 14)
            visits = [asyncio.ensure_future(client.post("/v1/recommend", json={
                "user_id": 17 + i})) for i in range(8)]
            await until(lambda: counters().shed_preinfer > 0)
        assert all(r.status_code == 200 for r in await asyncio.gather(*ranks))
        return list(await asyncio.gather(*visits))

    answers = run_with_client(service, body)
    assert all(r.status_code == 200 for r in answers)          # ranking still answered all
    skipped = [r for r in answers if r.json()["preinfer"]["action"] == "skipped"
               and r.json()["preinfer"]["reason"] is None]
    assert counters().shed_preinfer == len(skipped) > 0
    assert counters().shed_rank == 0


def test_in_flight_cap_refuses_at_the_door() -> None:
    service = make_service(server=ServerConfig(max_in_flight=2, retry_after_s=2.0))

    async def body(client: httpx.AsyncClient) -> list[httpx.Response]:
        async with held_compute(service):   # the first two stay in flight until released
            visits = [asyncio.ensure_future(client.post("/v1/recommend", json={
                "user_id": 1 + i})) for i in range(5)]
            await until(lambda: service.admission.refused == 3)
        return list(await asyncio.gather(*visits))

    answers = run_with_client(service, body)
    assert sorted(r.status_code for r in answers) == [200, 200, 503, 503, 503]
    for r in answers:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "2"
            assert r.json()["detail"] == "2 requests in flight (the limit)"
    assert service.admission.refused == 3
    assert service.backend.snapshot().counters.requests == 2


def test_one_user_cannot_take_every_slot() -> None:
    """A user's requests run one at a time (its lock), so a client that floods the server with
    one user's requests gets 503s past its share, and other users are still admitted."""
    service = make_service(server=ServerConfig(max_in_flight=4, max_in_flight_per_user=2,
                                               retry_after_s=2.0))

    async def body(client: httpx.AsyncClient) -> tuple[list[httpx.Response], httpx.Response]:
        async with held_compute(service):   # the first one computes, the second waits its turn
            flood = [asyncio.ensure_future(client.post("/v1/recommend", json={"user_id": 7}))
                     for _ in range(5)]
            await until(lambda: service.admission.refused == 3)
            assert service.admission.users == {7: 2} and service.admission.in_flight == 2
            other = asyncio.ensure_future(client.post("/v1/recommend", json={"user_id": 8}))
            await until(lambda: service.admission.in_flight == 3)
        return list(await asyncio.gather(*flood)), await other

    flood, other = run_with_client(service, body)
    assert sorted(r.status_code for r in flood) == [200, 200, 503, 503, 503]
    for r in flood:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "2"
            assert r.json()["detail"] == "2 requests of user 7 in flight (the per-user limit)"
    assert other.status_code == 200
    assert service.admission.users == {} and service.admission.in_flight == 0
    assert service.admission.refusals[DoorRefusal.USER_LIMIT] == 3


def test_a_per_user_limit_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_in_flight_per_user"):
        ServerConfig(max_in_flight_per_user=0)


def test_shutdown_drains_in_flight_requests() -> None:
    service = make_service()

    async def body(client: httpx.AsyncClient) -> None:
        async with held_compute(service):   # the slow request cannot finish until released
            slow = asyncio.ensure_future(client.post("/v1/recommend", json={"user_id": 2}))
            await until(lambda: service.admission.in_flight == 1)
            stopping = asyncio.ensure_future(service.stop())
            await until(lambda: service.admission.draining)
            late = await client.post("/v1/recommend", json={"user_id": 3})
            assert late.status_code == 503 and late.json()["detail"] == \
                "the server is shutting down"
            ready = await client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["draining"] is True
            assert not stopping.done()               # still waiting for the slow request
        answer = await slow
        assert answer.status_code == 200, answer.text
        await stopping
        assert service.lifecycle.drained_cleanly
        assert not any(i.healthy for i in service.backend.snapshot().instances)

    run_with_client(service, body)


def test_failed_instance_moves_its_users_and_answers_every_request() -> None:
    service = make_service()
    system = service.backend.system  # type: ignore[attr-defined]

    async def body(client: httpx.AsyncClient) -> None:
        owners = {}
        for user in range(1, 13):
            r = await client.post("/v1/recommend", json={"user_id": user})
            owners[user] = r.json()["instance"]
        assert set(owners.values()) == {"rank-0", "rank-1"}
        await system.fail_instance("rank-1")
        for user in range(1, 13):
            r = await client.post("/v1/recommend", json={"user_id": user})
            assert r.status_code == 200 and r.json()["instance"] == "rank-0"
        await system.restart_instance("rank-1")
        for user in range(1, 13):
            r = await client.post("/v1/recommend", json={"user_id": user})
            assert r.json()["instance"] == owners[user]        # ownership is deterministic

    run_with_client(service, body)


def _door_refusals(metrics: str) -> dict[str, float]:
    prefix = "relaygr_door_refusals_total{"
    return {line[len(prefix):].split('"')[1]: float(line.split()[-1])
            for line in metrics.splitlines() if line.startswith(prefix)}


def test_door_refusals_are_counted_by_reason_in_the_metrics() -> None:
    """A 503 at the door (the in-flight cap, draining) is told apart from a shed ranking leg, no
    healthy instance or the store out of reach: its own counter, one bounded reason label."""
    service = make_service(server=ServerConfig(max_in_flight=1))

    async def body(client: httpx.AsyncClient) -> None:
        assert _door_refusals((await client.get("/metrics")).text) == {
            "draining": 0.0, "in_flight_limit": 0.0, "user_in_flight_limit": 0.0}
        async with held_compute(service):
            slow = asyncio.ensure_future(client.post("/v1/recommend", json={"user_id": 1}))
            await until(lambda: service.admission.in_flight == 1)
            for user in (2, 3):
                capped = await client.post("/v1/recommend", json={"user_id": user})
                assert capped.status_code == 503
            stopping = asyncio.ensure_future(service.stop())
            await until(lambda: service.admission.draining)
            late = await client.post("/v1/events", json={"user_id": 4, "items": [1],
                                                         "timestamps": [1_900_000_000]})
            assert late.status_code == 503
            assert _door_refusals((await client.get("/metrics")).text) == {
                "draining": 1.0, "in_flight_limit": 2.0, "user_in_flight_limit": 0.0}
        assert (await slow).status_code == 200
        await stopping

    run_with_client(service, body)
