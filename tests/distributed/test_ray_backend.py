"""The Ray topology's logic without a cluster: ingress backend + Serve request router + replicas.

``LocalRanker`` runs the real ``RelayRequestRouter`` and real ``RankingReplica`` objects in this
process, so these tests check the ingress's two legs, follow, failover and shedding quickly; the
``ray``-marked tests repeat the key ones on a real local cluster.
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
import torch

from relaygr.cascade.window import HistoryWindow
from relaygr.distributed.health import ReplicaUnhealthyError
from relaygr.distributed.ingress import RayBackend
from relaygr.distributed.ledger import read_ledger
from relaygr.errors import SequenceTooLongError
from relaygr.routing import rendezvous_order
from relaygr.server import RelayService, ServerConfig
from relaygr.server.build import load_model, load_store
from tests.distributed.helpers import LocalRanker, full_scores
from tests.engine.helpers import failing_passes
from tests.server.helpers import SOURCE, client_for, system_config, until
from tests.server.test_window import serve_across_slides, slides_of
from tests.tolerance import SCORE_TOL

NAMES = ["replica-a", "replica-b"]


def service_over(ranker: LocalRanker, refresh_interval_s: float = 1.0) -> RelayService:
    model = load_model(SOURCE)
    store = load_store(SOURCE, model, HistoryWindow.for_model(model.cfg, ranker.system))
    backend = RayBackend(ranker, model, store, ranker.system,
                         refresh_interval_s=refresh_interval_s)
    return RelayService(backend, ServerConfig())


async def with_client(service: RelayService, body):  # type: ignore[no-untyped-def]
    async with client_for(service) as client:
        return await body(client)


def test_both_legs_reach_the_owner_and_scores_are_exact(tmp_path: Path) -> None:
    ranker = LocalRanker(NAMES, ledger=tmp_path)
    service = service_over(ranker)
    store = service.backend.store

    async def body(client: httpx.AsyncClient) -> None:
        for user in range(1, 11):
            history = store.get(user)
            r = await client.post("/v1/recommend", json={"user_id": user})
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["instance"] == out["preinfer"]["instance"] == \
                rendezvous_order(user, NAMES)[0]
            torch.testing.assert_close(
                torch.tensor(out["scores"]),
                full_scores(history.items, history.timestamps, out["candidates"]).float(),
                atol=SCORE_TOL, rtol=SCORE_TOL)
            assert out["path"] in ("pending_wait", "device_hit")

    asyncio.run(with_client(service, body))
    legs: dict[str, dict[str, str]] = defaultdict(dict)
    for row in read_ledger(tmp_path):
        legs[row.request_id][row.leg] = row.replica
        assert row.routed_to == row.replica           # the router's belief matched reality
    assert len(legs) == 10
    assert all(v["preinfer"] == v["rank"] for v in legs.values())
    assert {v["rank"] for v in legs.values()} == set(NAMES)


def test_prefill_then_rank_follows_and_events_append(tmp_path: Path) -> None:
    ranker = LocalRanker(NAMES, ledger=tmp_path)
    service = service_over(ranker)
    store = service.backend.store

    async def body(client: httpx.AsyncClient) -> None:
        pre = (await client.post("/v1/prefill", json={"user_id": 4})).json()
        ranked = (await client.post("/v1/rank", json={"user_id": 4,
                                                      "candidates": [5, 6, 7]})).json()
        assert ranked["instance"] == pre["instance"]
        assert ranked["path"] in ("pending_wait", "device_hit")
        n = store.num_events(4)
        timestamps = store.get(4).timestamps
        assert timestamps is not None
        last = int(timestamps[-1])
        visit = {"user_id": 4, "recent_items": [9], "recent_timestamps": [last + 1]}
        assert (await client.post("/v1/recommend", json=visit)).status_code == 200
        assert store.num_events(4) == n + 1
        assert service.backend.snapshot().counters.remembered_prefills == 0

    asyncio.run(with_client(service, body))


def test_a_dead_replica_loses_no_request_and_its_users_move(tmp_path: Path) -> None:
    ranker = LocalRanker(NAMES, ledger=tmp_path)
    service = service_over(ranker)
    store = service.backend.store
    victim = "replica-b"
    users = list(range(1, 13))
    owned = [u for u in users if rendezvous_order(u, NAMES)[0] == victim]
    assert owned

    async def body(client: httpx.AsyncClient) -> None:
        ranker.kill(victim)                           # dead, but still in the membership
        answers = await asyncio.gather(*[client.post("/v1/recommend", json={"user_id": u})
                                         for u in users])
        for user, r in zip(users, answers, strict=True):
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["instance"] == "replica-a"
            history = store.get(user)
            torch.testing.assert_close(
                torch.tensor(out["scores"]),
                full_scores(history.items, history.timestamps, out["candidates"]).float(),
                atol=SCORE_TOL, rtol=SCORE_TOL)
        ranker.forget(victim)                        # the membership catches up
        r = await client.post("/v1/recommend", json={"user_id": owned[0]})
        assert r.json()["instance"] == "replica-a"

    asyncio.run(with_client(service, body))
    assert service.backend.snapshot().counters.failovers == len(owned)
    served = {row.user_id for row in read_ledger(tmp_path) if row.leg == "rank"}
    assert served == set(users)
    assert all(row.replica == "replica-a" for row in read_ledger(tmp_path))


def test_a_replica_whose_calls_raise_is_answered_around_unless_the_request_is_at_fault(
        ) -> None:
    """The ingress sees a replica's error inside a ``RayTaskError``: the instance's own error
    (a device error) fails over to the user's next choice, which answers exactly, counted; the
    request's own (its input refused) is the answer, 422, and not failed over."""
    ranker = LocalRanker(NAMES)
    service = service_over(ranker)
    store = service.backend.store
    victim = "replica-b"
    owned = [u for u in range(1, 13) if rendezvous_order(u, NAMES)[0] == victim]
    passes = failing_passes(ranker.replicas[victim].instance, RuntimeError("CUDA error "
                                                                           "(injected)"))

    async def body(client: httpx.AsyncClient) -> None:
        for user in owned:
            r = await client.post("/v1/recommend", json={"user_id": user})
            assert r.status_code == 200 and r.json()["instance"] == "replica-a", r.text
            history = store.get(user)
            torch.testing.assert_close(
                torch.tensor(r.json()["scores"]),
                full_scores(history.items, history.timestamps, r.json()["candidates"]).float(),
                atol=SCORE_TOL, rtol=SCORE_TOL)
        passes.error = SequenceTooLongError("prefix + suffix past max_seq_len (injected)")
        r = await client.post("/v1/recommend", json={"user_id": owned[0]})
        assert r.status_code == 422 and "injected" in r.json()["detail"], r.text

    asyncio.run(with_client(service, body))
    counters = service.backend.snapshot().counters
    assert counters.failovers == counters.instance_errors == len(owned)


def test_a_replica_whose_calls_keep_raising_is_reported_and_avoided_until_replaced() -> None:
    """Three instance errors in a row open the replica's breaker: its health check fails (Serve
    replaces it), and once the ingress has its snapshot, /readyz gives the reason and both legs
    of its users go straight to their next choice, with no error to fail over from."""
    ranker = LocalRanker(NAMES)
    service = service_over(ranker, refresh_interval_s=3600.0)    # the test refreshes
    backend = service.backend
    assert isinstance(backend, RayBackend)
    victim = "replica-b"
    owned = [u for u in range(1, 30) if rendezvous_order(u, NAMES)[0] == victim][:5]
    assert len(owned) == 5

    async def body(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/recommend", json={"user_id": owned[0]})
        assert r.json()["instance"] == victim                   # the ingress knows it
        failing_passes(ranker.replicas[victim].instance, RuntimeError("CUDA error (injected)"))
        for user in owned[1:4]:
            r = await client.post("/v1/recommend", json={"user_id": user})
            assert r.status_code == 200 and r.json()["instance"] == "replica-a", r.text
        reason = ("circuit breaker open: 3 ranking calls in a row raised (the last: "
                  "RuntimeError: CUDA error (injected))")
        with pytest.raises(ReplicaUnhealthyError, match=re.escape(reason)):
            await ranker.replicas[victim].check_health()
        await backend.fleet.refresh()               # as every refresh_interval_s
        ready = (await client.get("/readyz")).json()
        assert ready["healthy_instances"] == 1 and ready["unhealthy"] == {victim: reason}
        sent = len(ranker.sent)
        for user in (owned[0], owned[4]):
            r = await client.post("/v1/recommend", json={"user_id": user})
            assert r.status_code == 200 and r.json()["instance"] == "replica-a", r.text
            assert r.json()["preinfer"]["instance"] == "replica-a"
        assert {name for _, name in ranker.sent[sent:]} == {"replica-a"}

    asyncio.run(with_client(service, body))
    counters = backend.snapshot().counters
    assert counters.failovers == counters.instance_errors == 3


def test_a_replica_gone_with_no_call_on_it_leaves_readyz_and_the_metrics() -> None:
    ranker = LocalRanker(NAMES)
    service = service_over(ranker, refresh_interval_s=0.01)
    owners = {rendezvous_order(u, NAMES)[0]: u for u in range(1, 13)}
    assert set(owners) == set(NAMES)

    async def body(client: httpx.AsyncClient) -> None:
        for user in owners.values():          # both replicas answer: both are known
            assert (await client.post("/v1/recommend", json={"user_id": user})).status_code == 200
        assert (await client.get("/readyz")).json()["healthy_instances"] == 2
        ranker.kill("replica-b")
        ranker.forget("replica-b")            # Serve replaced it: no call will go to it again
        await until(lambda: len(service.backend.snapshot().instances) == 1)
        ready = (await client.get("/readyz")).json()
        assert ready["healthy_instances"] == 1 and ready["instances"] == 1
        metrics = (await client.get("/metrics")).text
        assert 'relaygr_instance_healthy{instance="replica-a"} 1.0' in metrics
        assert "replica-b" not in metrics

    asyncio.run(with_client(service, body))


def test_replica_sheds_ranking_as_503(tmp_path: Path) -> None:
    ranker = LocalRanker(NAMES, system=system_config(
        overload={"max_rank_queue_depth": 1}, instance={"batch": {"max_requests": 1}},
        slo_ms=1500.0))
    service = service_over(ranker)

    async def body(client: httpx.AsyncClient) -> list[httpx.Response]:
        return list(await asyncio.gather(*[
            client.post("/v1/rank", json={"user_id": 1 + i % 10,
                                          "candidates": list(range(1, 200))})
            for i in range(20)]))

    answers = asyncio.run(with_client(service, body))
    shed = [r for r in answers if r.status_code == 503]
    assert shed and len(shed) + sum(r.status_code == 200 for r in answers) == 20
    assert all(r.headers["retry-after"] == "2" for r in shed)
    assert service.backend.snapshot().counters.shed_rank == len(shed)


def test_the_ingress_reads_the_same_sliding_window(tmp_path: Path) -> None:
    ranker = LocalRanker(NAMES, ledger=tmp_path)
    service = service_over(ranker)
    store = service.backend.store
    user = max(store, key=store.num_events)

    async def body(client: httpx.AsyncClient) -> None:
        answers = await serve_across_slides(client, service, user)
        counters = service.backend.snapshot().counters
        assert counters.window_slides == slides_of(8, 40)
        assert counters.windowed_requests == 8
        assert {a["path"] for a in answers} <= {"pending_wait", "device_hit", "host_hit"}

    asyncio.run(with_client(service, body))
