"""Turning arrival times into visits: who visits in each slot, and what each visit carries.

Send times are Poisson at the offered QPS whatever the population; a ``VisitAssigner`` (a policy)
then decides which user fills each arrival slot, and a ``Population`` supplies each user's initial
history and the events of each visit. ``assemble`` joins them into a ``Workload``.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from relaygr.bench.workload.base import (
    BenchRequest,
    StageDelays,
    Workload,
    WorkloadHistory,
    ZipfSampler,
)
from relaygr.errors import ConfigError


@dataclass(frozen=True, eq=False)
class VisitEvents:
    """The behaviours a user produced since the previous visit, and the visit's request time."""

    items: np.ndarray
    timestamps: np.ndarray | None
    request_ts: int | None


class Population(Protocol):
    """Users' initial histories and per-visit events, each a pure function of its arguments."""

    def history(self, user_id: int) -> WorkloadHistory: ...

    def visit_events(self, user_id: int, visit_index: int, send_s: float,
                     prev_ts: int | None) -> VisitEvents: ...


class VisitAssigner(Protocol):
    """A policy choosing the user of each arrival slot; returns one user id per slot."""

    def assign(self, send_s: np.ndarray, rng: np.random.Generator) -> np.ndarray: ...


class ZipfRevisitAssigner:
    """Zipf-popular users, plus short-gap sessions for a share of them.

    A slot goes to a due short-gap revisit if one is pending, else to a Zipf draw. When a
    short-gap user visits with no revisit pending, it starts a session: ``session_visits - 1``
    follow-up visits, each an exponential ``gap_mean_s`` after the previous one (seconds: the
    refresh / pagination reuse the host tier exists for). A user never exceeds
    ``max_visits_per_user``; Zipf draws of a capped user are redrawn (this bounds how far
    appended events grow a prefix during a run).
    """

    def __init__(self, users: ZipfSampler, short_gap: np.ndarray, gap_mean_s: float,
                 session_visits: int, max_visits_per_user: int | None) -> None:
        if gap_mean_s <= 0 or session_visits < 1:
            raise ConfigError("short-gap sessions need gap_mean_s > 0 and session_visits >= 1")
        if max_visits_per_user is not None and max_visits_per_user < 1:
            raise ConfigError("max_visits_per_user must be >= 1 when set")
        self._users, self._short_gap = users, short_gap
        self._gap_mean_s, self._session_visits = gap_mean_s, session_visits
        self._cap = max_visits_per_user

    def assign(self, send_s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self._cap is not None and self._users.n * self._cap < len(send_s):
            raise ConfigError(f"{self._users.n} users x {self._cap} visits cannot fill "
                              f"{len(send_s)} requests")
        out = np.empty(len(send_s), dtype=np.int64)
        visits: dict[int, int] = {}
        pending: list[tuple[float, int]] = []   # (due_s, user) of scheduled revisits
        pending_users: set[int] = set()
        left: dict[int, int] = {}               # follow-ups left after the pending one
        stream = _DrawStream(self._users, rng)
        for slot, t in enumerate(send_s.tolist()):
            user = self._due_revisit(pending, pending_users, visits, t)
            if user is None:
                user = self._next_uncapped(stream, visits)
            out[slot] = user
            visits[user] = visits.get(user, 0) + 1
            if not self._short_gap[user] or user in pending_users:
                continue
            remaining = left.pop(user, self._session_visits - 1)  # none left: a new session
            if remaining > 0 and not self._capped(visits, user):
                left[user] = remaining - 1
                heapq.heappush(pending, (t + rng.exponential(self._gap_mean_s), user))
                pending_users.add(user)
        return out

    def _capped(self, visits: dict[int, int], user: int) -> bool:
        return self._cap is not None and visits.get(user, 0) >= self._cap

    def _due_revisit(self, pending: list[tuple[float, int]], pending_users: set[int],
                     visits: dict[int, int], t: float) -> int | None:
        while pending and pending[0][0] <= t:
            user = heapq.heappop(pending)[1]
            pending_users.discard(user)
            if not self._capped(visits, user):
                return user
        return None

    def _next_uncapped(self, stream: _DrawStream, visits: dict[int, int]) -> int:
        for _ in range(100_000):
            user = stream.next()
            if not self._capped(visits, user):
                return user
        raise ConfigError("Zipf draws keep hitting capped users: raise max_visits_per_user "
                          "or num_users")


class _DrawStream:
    """Zipf draws one at a time, sampled in vectorised batches."""

    def __init__(self, sampler: ZipfSampler, rng: np.random.Generator) -> None:
        self._sampler, self._rng = sampler, rng
        self._buffer: list[int] = []

    def next(self) -> int:
        if not self._buffer:
            self._buffer = self._sampler.sample(self._rng, 256).tolist()[::-1]
        return int(self._buffer.pop())


class FixedVisitsAssigner:
    """Each of the first ``ceil(slots / visits)`` users of ``users`` visits ``visits`` times
    (the last may visit fewer), in a uniformly random interleaving."""

    def __init__(self, users: np.ndarray, visits: int) -> None:
        if visits < 1:
            raise ConfigError(f"visits per user must be >= 1, got {visits}")
        self._users, self._visits = users, visits

    def assign(self, send_s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        needed = -(-len(send_s) // self._visits)
        if needed > len(self._users):
            raise ConfigError(f"{len(send_s)} requests at {self._visits} visits per user need "
                              f"{needed} users; the population has {len(self._users)}")
        slots = np.repeat(self._users[:needed], self._visits)[: len(send_s)]
        return rng.permutation(slots).astype(np.int64)


def assemble(name: str, population: Population, users: np.ndarray, send_s: np.ndarray,
             num_items: int, num_candidates: int, stage_delays: StageDelays, qps: float,
             seed: int, params: Mapping[str, object]) -> Workload:
    """A workload from slot users and send times: histories of visiting users + requests."""
    histories = {int(u): population.history(int(u)) for u in np.unique(users)}
    prev_ts = {u: h.last_ts for u, h in histories.items()}
    visit_index: dict[int, int] = {}
    requests = []
    for request_id, (t, user_raw) in enumerate(zip(send_s.tolist(), users.tolist(), strict=True)):
        user = int(user_raw)
        k = visit_index.get(user, 0)
        visit_index[user] = k + 1
        events = population.visit_events(user, k, t, prev_ts[user])
        if events.request_ts is not None:
            prev_ts[user] = events.request_ts
        requests.append(BenchRequest(
            request_id=request_id, user_id=user, send_s=float(t),
            recent_items=tuple(events.items.tolist()),
            recent_timestamps=(None if events.timestamps is None
                               else tuple(events.timestamps.tolist())),
            request_ts=events.request_ts, num_candidates=num_candidates))
    return Workload(name=name, num_items=num_items, histories=histories,
                    requests=tuple(requests), stage_delays=stage_delays, qps=qps, seed=seed,
                    params=dict(params))
