"""Open-loop load over HTTP against a running server (for soak and failover runs).

Visits are sent at Poisson times whatever the server does (no coordinated omission): each is
its own task, and its end-to-end latency counts from its *scheduled* time. A share of visits
goes to a small hot set of users (revisits: the cache paths); the rest are uniform over the
users. Every visit gets an ``Outcome``: answered (with the server's ranking latency and path),
shed (503), rejected (4xx), failed (5xx) or lost (transport error, timeout). ``actions`` run at
given times during the load (in a thread, so a blocking call does not stall the schedule).
Sends wait with ``relaygr.wake.sleep_until``: asyncio's own timer ends up to a millisecond late,
and a late send is charged to the server (its end-to-end latency counts from the schedule).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from relaygr.wake import sleep_until


@dataclass(frozen=True)
class LoadSpec:
    qps: float
    duration_s: float
    users: tuple[int, ...]
    # 30% of visits to 50 hot users: revisits within seconds, what the host tier is for.
    hot_share: float = 0.3
    hot_users: int = 50
    seed: int = 0
    timeout_s: float = 30.0


@dataclass(frozen=True)
class Outcome:
    user_id: int
    scheduled_s: float
    status: int                      # HTTP status; 0 for a transport error or timeout
    e2e_ms: float
    ranking_ms: float | None = None
    path: str | None = None
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class LoadResult:
    outcomes: tuple[Outcome, ...]
    offered_qps: float
    duration_s: float
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, outcomes: Sequence[Outcome], qps: float, duration_s: float) -> LoadResult:
        kinds: Counter[str] = Counter()
        for o in outcomes:
            kinds["answered" if o.status == 200 else "shed" if o.status == 503 else
                  "rejected" if 400 <= o.status < 500 else "failed" if o.status >= 500
                  else "lost"] += 1
        return cls(tuple(outcomes), qps, duration_s, dict(kinds))

    def answered(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    def ranking_ms(self, q: float) -> float:
        """Percentile ``q`` (0-100, nearest rank) of the answered requests' ranking latency."""
        values = [o.ranking_ms for o in self.answered() if o.ranking_ms is not None]
        return float(np.percentile(values, q, method="inverted_cdf")) if values else math.nan

    def e2e_ms(self, q: float) -> float:
        values = [o.e2e_ms for o in self.answered()]
        return float(np.percentile(values, q, method="inverted_cdf")) if values else math.nan

    def paths(self) -> dict[str, int]:
        return dict(Counter(o.path for o in self.answered() if o.path is not None))


def schedule(spec: LoadSpec) -> list[tuple[float, int]]:
    """(send time in s from the start, user id) per visit: Poisson arrivals, hot-set revisits."""
    rng = np.random.default_rng(spec.seed)
    count = int(spec.qps * spec.duration_s)
    times = np.cumsum(rng.exponential(1.0 / spec.qps, count))
    users = np.asarray(spec.users)
    hot = users[: min(spec.hot_users, len(users))]
    picks = np.where(rng.random(count) < spec.hot_share, rng.choice(hot, count),
                     rng.choice(users, count))
    return [(float(t), int(u)) for t, u in zip(times, picks, strict=True)
            if t < spec.duration_s]


async def run_open_loop(url: str, spec: LoadSpec, keep_bodies: bool = False,
                        actions: Sequence[tuple[float, Callable[[], object]]] = (),
                        transport: httpx.AsyncBaseTransport | None = None) -> LoadResult:
    """Drive ``POST /v1/recommend`` at ``spec.qps`` for ``spec.duration_s`` (see module doc).
    ``transport``: httpx's (None: the network)."""
    plan = schedule(spec)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=spec.timeout_s, limits=limits,
                                 transport=transport) as client:
        loop = asyncio.get_running_loop()
        origin = loop.time()        # the schedule's zero, on the clock its sends wait on

        async def visit(at_s: float, user: int) -> Outcome:
            try:
                r = await client.post("/v1/recommend", json={"user_id": user})
            except httpx.HTTPError:
                return Outcome(user, at_s, 0, 1e3 * (loop.time() - origin - at_s))
            e2e_ms = 1e3 * (loop.time() - origin - at_s)
            if r.status_code != 200:
                return Outcome(user, at_s, r.status_code, e2e_ms)
            out = r.json()
            return Outcome(user, at_s, 200, e2e_ms, out["ranking_ms"], out["path"],
                           out if keep_bodies else None)

        async def act(at_s: float, action: Callable[[], object]) -> None:
            await sleep_until(origin + at_s)
            await asyncio.to_thread(action)

        side = [asyncio.ensure_future(act(t, a)) for t, a in actions]
        tasks = []
        for at_s, user in plan:
            if origin + at_s > loop.time():
                await sleep_until(origin + at_s)
            tasks.append(asyncio.ensure_future(visit(at_s, user)))
        outcomes = await asyncio.gather(*tasks)
        await asyncio.gather(*side)
    return LoadResult.of(outcomes, spec.qps, spec.duration_s)
