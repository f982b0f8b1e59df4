"""One request's path through the cascade, written once for every transport (DESIGN.md section 2).

    visit ─► window prefix ─► fleet.preinfer (route; trigger, unless shed; returns at once) ──┐
          └► retrieval ─► pre-processing (own fleets; measured, ≥ set delays)        first leg │
          ─► fleet.rank (follows the first leg; shed; failover to the next choice) ◄──────────┘
          ─► the visit's events are appended to the history (new prefix version)  second leg

The prefix is the part of the user's history the model reads: its newest events, in a window
that slides in blocks once the history outgrows the model (``cascade.window``: what is reused
between slides, what is recomputed at one). The counters count the slides.

``RequestPath`` is driven by the embedded system (``cascade.system.RelaySystem``: instances in
this process or in worker processes) and by the Ray ingress (``distributed.ingress``: replicas
behind Serve); they differ only in the ``Fleet`` (``cascade.fleet``) they hand it. Failover: a
ranking leg whose instance is gone, or raised for its own reasons (``cascade.fleet.failover_for``;
counted in ``instance_errors`` too), goes to the user's next choice (which recomputes), up to
the fleet's ``max_attempts``, so only latency suffers; the request's own errors (invalid input)
propagate at once. A ranking leg that the router moved off its first leg's instance without an
error (down, or out of routing, when the leg came: route reason ``FAILOVER``) is a failover
too. Each failover counts once in ``failovers``: each error, or the move when no error came
before it; and a request whose delivered pre-infer signal was on the instance it failed over
from counts it once in ``lost_preinfer`` (the relay did nothing for it). Shedding: a shed
pre-infer signal costs only the relay; a shed ranking leg raises ``OverloadedError`` (HTTP
503).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from relaygr.cascade.first_leg import FirstLegPath, Leg, Suffix
from relaygr.cascade.fleet import FirstLeg, InstanceFailed, InstanceLost
from relaygr.cascade.stages import StageTiming
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.engine.types import RankJob, RankResult
from relaygr.errors import NoHealthyInstanceError, OverloadedError
from relaygr.routing import RouteDecision, RouteReason

# Ranking legs whose instance raised, logged with their traceback; the rest are counted only
# (an instance that keeps raising is taken out of routing, logged once, by its fleet).
_LOGGED_INSTANCE_ERRORS = 5

log = logging.getLogger("relaygr.cascade.request_path")


class RequestPath(FirstLegPath):
    """See the module docstring. One event loop drives it. Its parts, its state and its first
    leg are ``FirstLegPath``'s (``cascade.first_leg``); here the requests and the ranking leg."""

    async def recommend(self, visit: Visit) -> Recommendation:
        """The whole cascade for one visit: retrieval, pre-processing and relayed ranking."""
        arrived = asyncio.get_running_loop().time()    # the earlier stages' fleets start here
        leg = self._first_leg(visit, send=True)
        seen = np.concatenate([leg.history_items,
                               np.asarray(visit.recent_items, dtype=np.int64)])
        try:
            # the ranking leg's own inputs, made while the earlier stages run: once they end,
            # nothing but the call stands between them and ranking (0.4 ms off the critical
            # path at the benchmark's limit point; a shared store's round trip, off it too)
            leg.suffix = self._suffix(leg)
            earlier = await self.stages.run(seen, leg.num_candidates, visit.user_id, arrived)
        finally:
            first = await self._first(leg)
        return await self._second_leg(leg, first, first, earlier.candidates,
                                      earlier.timing, earlier.scores)

    async def rank_candidates(self, visit: Visit, candidates: Tensor) -> Recommendation:
        """Rank given candidates for a visit, consuming the relayed prefix when present: the
        user's ``prefill``, if its lease is not over (else the leg is routed afresh)."""
        prefilled = self._decisions.pop(visit.user_id, None)
        if prefilled is not None and prefilled.expires_s <= asyncio.get_running_loop().time():
            prefilled = None
        leg = self._first_leg(visit, send=False,
                              request_id=None if prefilled is None else prefilled.request_id)
        first = await self._first(leg)
        relayed = first if prefilled is None else prefilled.first
        return await self._second_leg(leg, first, relayed, candidates.to(torch.int64))

    def append_events(self, user_id: int, items: Sequence[int],
                      timestamps: Sequence[int] | None = None,
                      expected_events: int | None = None) -> int:
        """Append behaviour events (the prefix version changes); returns the new length.
        ``expected_events``: the append's precondition (``HistoryConflictError``)."""
        before = self.store.num_events(user_id) if user_id in self.store else 0
        after = self.store.append(user_id, items, timestamps, expected_events).num_events
        self.counters.window_slides += int(before > 0 and self.window.slid(before, after))
        return after

    # ---- the second leg ----------------------------------------------------------------------
    async def _second_leg(self, leg: Leg, first: FirstLeg, relayed: FirstLeg,
                          candidates: Tensor, stages: StageTiming | None = None,
                          stage_scores: Tensor | None = None) -> Recommendation:
        """The ranking leg, following ``relayed`` (the first leg whose pre-infer it relays:
        ``first``, or the ``prefill`` that began the request)."""
        visit, spec = leg.visit, leg.spec
        suffix = leg.suffix or self._suffix(leg)
        job = RankJob(spec, candidates, suffix.items, suffix.timestamps, visit.request_ts,
                      suffix.grown)
        due = time.perf_counter()
        try:
            result, failed_over = await self._rank(leg, relayed.route, job)
        except BaseException:         # shed, or no instance answered: no leg comes
            await self._abandon(leg, relayed, None)
            raise
        done = time.perf_counter()
        if failed_over:
            await self._abandon(leg, relayed, result.instance)
        preinfer = await self._outcome(first)      # before the append: nothing can fail after
        self._count_relay_lost(relayed, failed_over, result.instance)
        if visit.recent_items:
            self.append_events(visit.user_id, visit.recent_items, visit.recent_timestamps,
                               visit.expected_events)
        self.counters.requests += 1
        self.counters.windowed_requests += int(spec.window_start > 0)
        self.counters.paths[result.path.value] += 1
        return Recommendation(candidates, result.scores, result.path, result.instance,
                              preinfer, first.instance, spec.num_tokens,
                              job.suffix_tokens, due, done, result.timing, spec.window_start,
                              stages, stage_scores,
                              0.0 if stages is None else self.config.stages.stage_weight)

    def _suffix(self, leg: Leg) -> Suffix:
        """The visit's events as tensors, after the stored event the window's prefix held back
        (``cascade.window``), and the prefix they grow (none without new events). The prefix's
        events are in the store already and a store only appends, so the identity is the same
        whenever it is computed before the visit's own append."""
        visit, split = leg.visit, leg.window_prefix
        if not visit.recent_items and not split.held:
            return Suffix(None, None, None)
        grown = self.window.grown(self.store, split, visit.recent_items,
                                  visit.recent_timestamps)
        items = np.concatenate([split.held_items, np.asarray(visit.recent_items, np.int64)])
        # a held event is timed, and so are the visit's events then (``grown`` checked them)
        times = [t for t in (split.held_timestamps, visit.recent_timestamps) if t is not None]
        timestamps = torch.from_numpy(np.concatenate([np.asarray(t, np.int64) for t in times])
                                      ) if times else None
        return Suffix(torch.from_numpy(items.astype(np.int64)), timestamps, grown)

    async def _rank(self, leg: Leg, route: RouteDecision | None, job: RankJob
                    ) -> tuple[RankResult, bool]:
        """The ranking leg's result, and whether it failed over (an instance lost or raised, or
        the router moved it off its first leg's instance: each counted once)."""
        avoid: tuple[str, ...] = ()
        last: InstanceLost | None = None
        for _ in range(self.fleet.max_attempts):
            try:
                ranked = await self.fleet.rank(leg.request_id, leg.visit.user_id, route, job,
                                               avoid)
            except OverloadedError:           # the fleet's shed rule refused the leg
                self.counters.shed_rank += 1
                raise
            except InstanceLost as lost:
                last = lost
                self.counters.failovers += 1
                if isinstance(lost, InstanceFailed):
                    self._count_error(lost)
                if lost.instance is not None:
                    avoid += (lost.instance,)
                continue
            moved = ranked.route.reason is RouteReason.FAILOVER
            if moved and last is None:        # moved without an error, which counted it
                self.counters.failovers += 1
            return ranked.result, moved or last is not None
        raise NoHealthyInstanceError(
            f"ranking failed on {self.fleet.max_attempts} instances in turn") from last

    async def _abandon(self, leg: Leg, relayed: FirstLeg, answered_by: str | None) -> None:
        """The pre-infer ``relayed`` delivered sees no ranking leg where it went (the leg was
        shed, failed, or answered by ``answered_by``, elsewhere): its instance frees it."""
        if relayed.instance is None or relayed.instance == answered_by:
            return
        await self._outcome(relayed)      # (from another process) it reached the instance
        if not (relayed.shed or relayed.lost):
            self.fleet.abandon(leg.request_id, relayed, leg.spec.pid)

    def _count_relay_lost(self, relayed: FirstLeg, failed_over: bool, answered_by: str) -> None:
        """A ranking leg that failed over from the instance its pre-infer signal was delivered
        to lost that signal (one already lost or shed was counted as such)."""
        delivered = relayed.instance is not None and not (relayed.shed or relayed.lost)
        if failed_over and delivered and answered_by != relayed.instance:
            self.counters.lost_preinfer += 1

    def _count_error(self, failed: InstanceFailed) -> None:
        self.counters.instance_errors += 1
        if self.counters.instance_errors <= _LOGGED_INSTANCE_ERRORS:
            log.warning("ranking on %s raised; the leg fails over to the user's next choice",
                        failed.instance, exc_info=failed.error)
