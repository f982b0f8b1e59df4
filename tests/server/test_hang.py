"""A hung instance process (SIGSTOP: alive, silent) is seen, routed around, killed and restarted
by the supervisor, with every answer still exact, the event counted in the metrics, and /readyz
false while no instance can serve."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relaygr.server import RelayService
from tests.server.helpers import make_service, run_with_client, until
from tests.server.test_api import assert_scores, reference_scores

# Spawns, stops, kills and restarts instance processes: slow, and run by CI with -m slow.
pytestmark = pytest.mark.slow

# A hang guard, not a verdict: each restart takes a process start (seconds on a busy machine).
GUARD_S = 180.0


def _metrics(text: str) -> dict[tuple[str, str], float]:
    """(family, event label or "") -> value, for the counters this test reads."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("relaygr_instance_events_total", "relaygr_failovers_total"):
                out[sample.name, sample.labels.get("event", "")] = sample.value
    return out


def test_a_stopped_instance_process_is_routed_around_killed_and_restarted() -> None:
    service: RelayService = make_service(instance_processes=True)
    system = service.backend.system  # type: ignore[attr-defined]
    counts = system.supervisor.counts

    async def recommend(client: httpx.AsyncClient, user: int) -> str:
        """One exact answer for ``user``; the instance that ranked it."""
        r = await client.post("/v1/recommend", json={"user_id": user})
        assert r.status_code == 200, r.text
        out = r.json()
        assert_scores(out["scores"], reference_scores(service, user, out["candidates"]))
        return str(out["instance"])

    async def body(client: httpx.AsyncClient) -> None:
        owners = {user: await recommend(client, user) for user in range(1, 9)}
        users_of_0 = [u for u, name in owners.items() if name == "rank-0"]
        assert users_of_0 and len(users_of_0) < len(owners)   # both instances serve
        pid = system.instances[0].link.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            # rank-0's users first: their requests wait on the stopped process until it is
            # judged hung and killed, then fail over and are recomputed on rank-1, exactly
            for user in users_of_0 + [u for u in owners if u not in users_of_0]:
                assert await recommend(client, user) == "rank-1"
        finally:
            if system.instances[0].link.process.pid == pid:
                os.kill(pid, signal.SIGCONT)    # never leave a stopped process behind
        await until(lambda: counts.restarts == 1, GUARD_S)
        assert system.instances[0].healthy
        assert system.instances[0].link.process.pid != pid
        assert (counts.hangs, counts.deaths, counts.given_up) == (1, 0, [])
        assert "rank-0" in {await recommend(client, user) for user in users_of_0}
        seen = _metrics((await client.get("/metrics")).text)
        assert seen["relaygr_instance_events_total", "hang"] == 1
        assert seen["relaygr_instance_events_total", "death"] == 0
        assert seen["relaygr_instance_events_total", "restart"] == 1
        assert seen["relaygr_failovers_total", ""] >= 1

        # no instance can serve: both stopped; not ready until they are restarted
        pids = [inst.link.process.pid for inst in system.instances]
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        await until(lambda: not any(inst.healthy for inst in system.instances), GUARD_S)
        ready = await client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["healthy_instances"] == 0
        await until(lambda: counts.restarts == 3, GUARD_S)
        ready = await client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["healthy_instances"] == 2
        assert counts.hangs == 3
        await recommend(client, users_of_0[0])

    run_with_client(service, body)
