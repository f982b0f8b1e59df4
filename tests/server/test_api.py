"""The HTTP API end to end, in-process: every endpoint, the relay's paths, exact scores, metrics."""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from relaygr.routing import rendezvous_order
from relaygr.server import RelayService
from tests.engine.helpers import failing_passes
from tests.server.helpers import make_service, run_with_client
from tests.tolerance import SCORE_TOL


def reference_scores(service: RelayService, user_id: int, candidates: list[int]) -> torch.Tensor:
    """Full recompute of the user's current history with the served model."""
    system = service.backend.system  # type: ignore[attr-defined]
    history = system.store.get(user_id)
    ts = None if history.timestamps is None else torch.tensor(history.timestamps)
    return system.model.rank(torch.tensor(candidates), prefix_items=torch.tensor(history.items),
                             prefix_timestamps=ts)


def assert_scores(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want.float(), atol=SCORE_TOL, rtol=SCORE_TOL)


def test_recommend_ranks_exactly_and_revisits_reuse_the_prefix() -> None:
    service = make_service()
    store = service.backend.store

    async def body(client: httpx.AsyncClient) -> None:
        before = store.num_events(3)
        first = await client.post("/v1/recommend", json={"user_id": 3})
        assert first.status_code == 200, first.text
        out = first.json()
        assert len(out["candidates"]) == 16 and out["prefix_tokens"] == before
        assert_scores(out["scores"], reference_scores(service, 3, out["candidates"]))
        assert out["scores"] == sorted(out["scores"], reverse=True)   # the recommendation
        # The pre-infer signal and the ranking request met on one instance (affinity).
        assert out["preinfer"]["instance"] == out["instance"]
        assert out["preinfer"]["action"] == "prefill"
        assert out["path"] in ("pending_wait", "device_hit")

        timestamps = store.get(3).timestamps
        assert timestamps is not None
        last_ts = int(timestamps[-1])
        visit = {"user_id": 3, "recent_items": [7, 8], "recent_timestamps": [last_ts + 5,
                                                                           last_ts + 9],
                 "request_ts": last_ts + 10}
        second = await client.post("/v1/recommend", json=visit)
        assert second.status_code == 200, second.text
        assert second.json()["suffix_tokens"] == 2
        assert store.num_events(3) == before + 2          # the visit's events were appended
        assert tuple(int(i) for i in store.get(3).items[-2:]) == (7, 8)

        await service.backend.quiesce()
        third = (await client.post("/v1/recommend", json={"user_id": 3})).json()
        assert third["path"] in ("device_hit", "host_hit")   # reused, not recomputed
        assert_scores(third["scores"], reference_scores(service, 3, third["candidates"]))

    run_with_client(service, body)


def test_prefill_then_rank_lands_on_the_prefill_instance() -> None:
    service = make_service()

    async def body(client: httpx.AsyncClient) -> None:
        for user in (1, 2, 5, 9):
            pre = await client.post("/v1/prefill", json={"user_id": user, "num_candidates": 4})
            assert pre.status_code == 200, pre.text
            assert pre.json()["action"] == "prefill"
            candidates = [11, 42, 99, 7]
            ranked = await client.post("/v1/rank", json={  # 99.0 is an integer in JSON Schema
                "user_id": user, "candidates": [11, 42, 99.0, 7]})
            assert ranked.status_code == 200, ranked.text
            out = ranked.json()
            assert out["instance"] == pre.json()["instance"]
            assert out["path"] in ("pending_wait", "device_hit")
            assert out["candidates"] == candidates
            assert_scores(out["scores"], reference_scores(service, user, candidates))
        assert service.backend.snapshot().counters.remembered_prefills == 0

    run_with_client(service, body)


def test_prefill_announces_as_many_candidates_as_rank_accepts() -> None:
    """``/v1/prefill``'s ``num_candidates`` is the size of the ``/v1/rank`` that follows, so
    its limit is rank's (``max_candidates``), not what retrieval returns (``retrieval_k``, 64
    here: /v1/rank's candidates come from the caller's own stages)."""
    service = make_service()
    limit = service.config.max_candidates

    async def body(client: httpx.AsyncClient) -> None:
        candidates = list(range(1, 501)) * 4                  # 2,000: past retrieval_k
        pre = await client.post("/v1/prefill", json={"user_id": 3,
                                                     "num_candidates": len(candidates)})
        assert pre.status_code == 200, pre.text
        ranked = await client.post("/v1/rank", json={"user_id": 3, "candidates": candidates})
        assert ranked.status_code == 200, ranked.text
        assert ranked.json()["instance"] == pre.json()["instance"]
        over = await client.post("/v1/prefill", json={"user_id": 3, "num_candidates": limit + 1})
        assert over.status_code == 422, over.text
        assert f"carries at most {limit} candidates" in over.json()["detail"]

    run_with_client(service, body)


def test_events_append_and_create_users() -> None:
    service = make_service()
    store = service.backend.store

    async def body(client: httpx.AsyncClient) -> None:
        n = store.num_events(4)
        timestamps = store.get(4).timestamps
        assert timestamps is not None
        last_ts = int(timestamps[-1])
        r = await client.post("/v1/events", json={"user_id": 4, "items": [1, 2, 3],
                                                  "timestamps": [last_ts, last_ts, last_ts + 1]})
        assert r.status_code == 200 and r.json() == {"user_id": 4, "num_events": n + 3}
        new = await client.post("/v1/events", json={"user_id": 10_000, "items": [5, 6, 7],
                                                    "timestamps": [7, 8, 9]})
        assert new.json() == {"user_id": 10_000, "num_events": 3}
        assert store.get(10_000).timestamps.tolist() == [7, 8, 9]  # type: ignore[union-attr]
        ranked = await client.post("/v1/recommend", json={"user_id": 10_000})
        assert ranked.status_code == 200, ranked.text
        assert ranked.json()["prefix_tokens"] == 3

    run_with_client(service, body)


@pytest.mark.slow  # spawns instance processes
def test_instances_in_processes_serve_the_same_api() -> None:
    service = make_service(instance_processes=True)
    system = service.backend.system  # type: ignore[attr-defined]
    pids: list[int] = []

    async def body(client: httpx.AsyncClient) -> None:
        out = (await client.post("/v1/recommend", json={"user_id": 3})).json()
        assert out["preinfer"]["instance"] == out["instance"]
        assert_scores(out["scores"], reference_scores(service, 3, out["candidates"]))
        pre = (await client.post("/v1/prefill", json={"user_id": 5})).json()
        ranked = (await client.post("/v1/rank", json={"user_id": 5, "candidates": [4, 2]}))
        assert ranked.json()["instance"] == pre["instance"]
        assert_scores(ranked.json()["scores"], reference_scores(service, 5, [4, 2]))
        pids.extend(i.link.process.pid for i in system.instances)
        await system.fail_instance("rank-1")
        assert (await client.get("/readyz")).json()["healthy_instances"] == 1
        again = (await client.post("/v1/rank", json={"user_id": 5, "candidates": [4, 2]}))
        assert again.status_code == 200 and again.json()["instance"] == "rank-0"

    run_with_client(service, body)
    assert pids and all(not _alive(pid) for pid in pids)   # the service's stop ended them


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_health_readiness_and_openapi() -> None:
    service = make_service()

    async def body(client: httpx.AsyncClient) -> None:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        ready = await client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json() == {"ready": True, "draining": False, "healthy_instances": 2,
                                "instances": 2, "history_store": True,
                                "history_store_error": None, "unhealthy": {}}
        await service.backend.system.fail_instance("rank-1")   # type: ignore[attr-defined]
        ready = await client.get("/readyz")
        assert ready.json()["healthy_instances"] == 1
        assert ready.json()["unhealthy"] == {"rank-1": "down"}
        schema = (await client.get("/openapi.json")).json()
        assert {"/v1/recommend", "/v1/prefill", "/v1/rank", "/v1/events", "/healthz",
                "/readyz", "/metrics"} <= set(schema["paths"])
        rank_body = schema["components"]["schemas"]["RankRequest"]
        assert rank_body["additionalProperties"] is False
        assert rank_body["properties"]["candidates"]["minItems"] == 1

    run_with_client(service, body)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_report_paths_tiers_triggers_and_latency() -> None:
    service = make_service()

    async def body(client: httpx.AsyncClient) -> str:
        for user in (1, 2, 3, 1):
            assert (await client.post("/v1/recommend", json={"user_id": user})).status_code \
                == 200
        await client.post("/v1/rank", json={"user_id": 999, "candidates": [1]})   # 404
        await service.backend.quiesce()
        return (await client.get("/metrics")).text

    text = run_with_client(service, body)
    got = samples(text)
    paths = {k: v for k, v in got.items() if k[0] == "relaygr_rank_paths_total"}
    assert sum(paths.values()) == 4
    assert got[("relaygr_http_requests_total", (("endpoint", "/v1/recommend"),
                                                ("status", "200")))] == 4
    assert got[("relaygr_http_requests_total", (("endpoint", "/v1/rank"), ("status", "404")))] \
        == 1
    assert got[("relaygr_stage_seconds_count", (("endpoint", "recommend"),
                                               ("stage", "ranking")))] == 4
    assert got[("relaygr_stage_seconds_count", (("endpoint", "recommend"),
                                               ("stage", "earlier_stages")))] == 4
    assert sum(v for k, v in got.items() if k[0] == "relaygr_ranking_seconds_count") == 4
    admitted = {k: v for k, v in got.items() if k[0] == "relaygr_trigger_decisions_total"
                and ("reason", "admitted") in k[1]}
    assert sum(admitted.values()) == 3          # users 1, 2, 3 pre-inferred; 1's revisit hit
    for inst in ("rank-0", "rank-1"):
        for tier in ("device", "host"):
            labels = (("instance", inst), ("tier", tier))
            assert ("relaygr_cache_used_bytes", labels) in got
            assert got[("relaygr_cache_budget_bytes", labels)] > 0
        assert got[("relaygr_queue_depth", (("instance", inst), ("queue", "rank")))] == 0
    hits = sum(v for k, v in got.items() if k[0] == "relaygr_cache_hits_total")
    assert hits >= 1

    def lookups(name: str, tier: str) -> float:
        return sum(v for k, v in got.items() if k[0] == name and ("tier", tier) in k[1])

    # each ranking request is one lookup of the device, and of the host when the device missed
    device_misses = lookups("relaygr_cache_misses_total", "device")
    assert lookups("relaygr_cache_hits_total", "device") + device_misses == 4
    assert lookups("relaygr_cache_hits_total", "host") \
        + lookups("relaygr_cache_misses_total", "host") == device_misses
    assert got[("relaygr_shed_total", (("leg", "rank"),))] == 0


def test_a_user_with_nothing_left_to_recommend_gets_a_typed_error_and_others_are_served(
        ) -> None:
    """A user who has seen every item of the catalogue: 422 ``NoCandidatesError`` before any
    ranking work is queued, and the next user is served as before."""
    service = make_service()

    async def body(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/events", json={"user_id": 9_999, "items": list(range(1, 501)),
                                                  "timestamps": list(range(1, 501))})
        assert r.status_code == 200
        r = await client.post("/v1/recommend", json={"user_id": 9_999})
        assert r.status_code == 422 and r.json()["error"] == "NoCandidatesError", r.text
        system = service.backend.system  # type: ignore[attr-defined]
        assert all(i.scheduler.stats.rank_requests == 0 for i in system.instances)
        r = await client.post("/v1/recommend", json={"user_id": 1})
        assert r.status_code == 200 and len(r.json()["candidates"]) == 16

    run_with_client(service, body)


def test_metrics_export_what_failed_or_was_refused() -> None:
    """The cache's failures and refusals, the ranking batches split after a failure and the
    pre-infer signals lost with their instance are families of /metrics, per instance."""
    service = make_service()

    async def body(client: httpx.AsyncClient) -> str:
        assert (await client.post("/v1/recommend", json={"user_id": 1})).status_code == 200
        await service.backend.quiesce()
        return (await client.get("/metrics")).text

    got = samples(run_with_client(service, body))
    for inst in ("rank-0", "rank-1"):
        for event in ("prefills_failed", "reloads_failed", "background_failed",
                      "admission_refused", "fill_refused"):
            assert got[("relaygr_residency_events_total",
                        (("event", event), ("instance", inst)))] == 0
        for event in ("failed", "refused", "demotion_refusals"):
            assert ("relaygr_expander_events_total",
                    (("event", event), ("instance", inst))) in got
        for event in ("split", "failed"):
            assert got[("relaygr_rank_failures_total",
                        (("event", event), ("instance", inst)))] == 0
        for tier in ("device", "host"):
            for reason in ("evicted", "expired", "aborted"):
                assert ("relaygr_cache_removals_total",
                        (("instance", inst), ("reason", reason), ("tier", tier))) in got
    assert not any(k[0] == "relaygr_expander_events_total" and ("event", "reload_bytes") in k[1]
                   for k in got)
    started = sum(v for k, v in got.items() if k[0] == "relaygr_residency_events_total"
                  and ("event", "prefills_started") in k[1])
    assert started == 1                          # user 1's pre-infer
    assert got[("relaygr_lost_preinfer_total", ())] == 0


@pytest.mark.parametrize("mode", ["baseline", "reactive"])
def test_other_modes_serve_the_same_scores(mode: str) -> None:
    from tests.server.helpers import system_config
    service = make_service(system_config(mode=mode))

    async def body(client: httpx.AsyncClient) -> None:
        out = (await client.post("/v1/rank", json={"user_id": 6, "candidates": [3, 1, 4]}))
        assert out.status_code == 200, out.text
        assert out.json()["path"] == "full"
        assert_scores(out.json()["scores"], reference_scores(service, 6, [3, 1, 4]))

    run_with_client(service, body)


def test_an_instance_whose_passes_raise_is_answered_around_and_reported_out() -> None:
    """Each of rank-1's users still gets 200 with the full pass's scores (answered by rank-0);
    after three errors in a row rank-1's circuit breaker takes it out: /readyz names it with the
    reason, and /metrics counts the errors and the breaker's opening."""
    service = make_service()
    system = service.backend.system  # type: ignore[attr-defined]
    failing_passes(system.by_name["rank-1"], RuntimeError("CUDA error (injected)"))
    users = [u for u in range(1, 24) if rendezvous_order(u, ["rank-0", "rank-1"])[0] == "rank-1"]

    async def body(client: httpx.AsyncClient) -> tuple[dict[str, Any], str]:
        for user in users[:4]:
            r = await client.post("/v1/recommend", json={"user_id": user})
            assert r.status_code == 200 and r.json()["instance"] == "rank-0", r.text
            assert_scores(r.json()["scores"], reference_scores(service, user,
                                                               r.json()["candidates"]))
        ready = await client.get("/readyz")
        assert ready.status_code == 200
        return ready.json(), (await client.get("/metrics")).text

    ready, text = run_with_client(service, body)
    assert ready["healthy_instances"] == 1 and ready["unhealthy"] == {
        "rank-1": "circuit breaker open: 3 ranking calls in a row raised (the last: "
                  "RuntimeError: CUDA error (injected))"}
    got = samples(text)
    assert got[("relaygr_instance_errors_total", ())] == 3
    assert got[("relaygr_failovers_total", ())] == 3
    assert got[("relaygr_instance_events_total", (("event", "breaker_open"),))] == 1
    assert got[("relaygr_instance_healthy", (("instance", "rank-1"),))] == 0
