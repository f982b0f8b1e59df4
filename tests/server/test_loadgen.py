"""The HTTP load generator: every visit gets an outcome, and its latency counts from its schedule.

Run on virtual time (``tests.virtual_time``) against an httpx mock transport, so every latency
is an exact function of the schedule and the fake server's delays, on any machine.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from relaygr.server.loadgen import LoadSpec, run_open_loop, schedule
from tests.virtual_time import run_virtual

SERVE_S = 0.005          # the fake server's time per request


def _spec() -> LoadSpec:
    return LoadSpec(qps=50.0, duration_s=2.0, users=tuple(range(20)), seed=3)


def _server(statuses: dict[int, int], stall: tuple[int, float] | None = None,
            lost: int | None = None) -> httpx.MockTransport:
    """Answers each user after ``SERVE_S`` with ``statuses.get(user, 200)``; ``stall``:
    (visit number, seconds) blocks the client's loop once, as a blocking call would; ``lost``:
    a user whose requests fail in transport."""
    seen = 0

    async def handle(request: httpx.Request) -> httpx.Response:
        nonlocal seen
        seen += 1
        if stall is not None and seen == stall[0]:
            loop = asyncio.get_running_loop()
            loop.advance(stall[1])      # type: ignore[attr-defined]
        user = json.loads(request.content)["user_id"]
        await asyncio.sleep(SERVE_S)
        if user == lost:
            raise httpx.ConnectError("refused", request=request)
        status = statuses.get(user, 200)
        body = {"ranking_ms": 1.5, "path": "full"} if status == 200 else {"detail": "no"}
        return httpx.Response(status, json=body)

    return httpx.MockTransport(handle)


def test_every_visit_is_sent_on_schedule_and_classified() -> None:
    spec = _spec()
    plan = schedule(spec)
    transport = _server({1: 503, 2: 422, 3: 500}, lost=4)
    result = run_virtual(run_open_loop("http://test", spec, transport=transport))

    assert [(o.scheduled_s, o.user_id) for o in result.outcomes] == plan
    users = [u for _, u in plan]
    assert result.counts == {k: v for k, v in {
        "answered": sum(u not in (1, 2, 3, 4) for u in users), "shed": users.count(1),
        "rejected": users.count(2), "failed": users.count(3), "lost": users.count(4)}.items()
        if v}
    # sent on time, answered after the server's time: nothing else is charged
    assert all(o.e2e_ms == pytest.approx(1e3 * SERVE_S, abs=1e-6) for o in result.outcomes)
    assert result.ranking_ms(50) == 1.5 and result.paths() == {"full": result.counts["answered"]}


def test_a_late_send_is_charged_from_its_scheduled_time() -> None:
    """No coordinated omission: visits due while the client's loop was blocked go out late, and
    their latency counts the wait from when they were due."""
    spec = _spec()
    plan = schedule(spec)
    stall_s = 0.2
    result = run_virtual(run_open_loop("http://test", spec,
                                       transport=_server({}, stall=(1, stall_s))))

    first = plan[0][0]
    blocked_until = first + stall_s           # the first visit's handler blocked the loop
    for outcome in result.outcomes[1:]:
        late = max(0.0, blocked_until - outcome.scheduled_s)
        assert outcome.e2e_ms == pytest.approx(1e3 * (late + SERVE_S), abs=1e-6)
    assert sum(o.scheduled_s < blocked_until for o in result.outcomes[1:]) >= 2
