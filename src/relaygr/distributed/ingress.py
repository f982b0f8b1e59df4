"""The Ray ingress: the cascade's request path over Ray Serve replicas, and the HTTP API.

``RayBackend`` is the ``RelayBackend`` of the Ray topology. A visit takes the same path as in
the embedded system (``cascade.request_path.RequestPath``: window prefix, the two legs, earlier
stages meanwhile, failover, appending the visit); only the transport differs. ``ReplicaFleet``
sends the first leg (``PreinferCall``) to the ranking deployment as the visit arrives and the
second (``RankCall``) with ``follow`` set to the replica that took the first, so Serve's request
router (``RelayRequestRouter``) sends both legs of the request to the replica that owns the user.

Fallbacks: a lost pre-infer leg only costs the relay (ranking recomputes); a ranking leg whose
replica died, or whose replica's call raised for the instance's own reasons (Serve hands the
ingress the replica's exception inside a ``RayTaskError``; ``cascade.fleet.failover_for`` judges
it as for an embedded instance), is sent again with that replica in ``avoid`` (the user's next
choice, which recomputes), up to ``max_attempts`` times; the request's own errors propagate.
A replica judges itself (``distributed.health``: its instance stopped or stuck, or its ranking
calls raising ``errors_to_open`` times in a row, the embedded circuit breaker's rule): its health
check fails until Serve replaces it, and the snapshots it reports say it is unhealthy, with the
reason. Both legs avoid a replica whose last snapshot says so (``unhealthy``), so its users go to
their next choice before Serve has replaced it; the request router ignores an ``avoid`` that names
every replica, as the embedded breakers never take out every instance. A replica sheds by the
cascade's shed rules (``cascade.fleet``) on its own queue: a shed ranking leg answers overloaded,
and the request gets 503.

The earlier stages run here, in the ingress, as in the embedded system: the retrieval stage a
``RetrievalStage`` (a trained run's, loaded by the ingress from its run directory, or the model's
item embeddings), its measured time in the answer's ``timings``, its scores fused after ranking
(``StagesConfig.stage_weight``) by the same ``RequestPath``.

The ingress learns the replicas and their snapshots (for /metrics and /readyz) from their
replies, so a replica that dies with no call on it would stay listed, healthy, forever: the
backend therefore asks every replica it knows for its state every ``refresh_interval_s``, and
drops one that is gone (its call fails, or Serve's router, which no longer has it, lets another
replica answer).

``RelayIngress`` (``distributed.app``) is the Serve deployment class: it builds the model (and
checks its digest), the store, the retrieval stage and a ``RelayService`` over a ``RayBackend``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import ReplicaUnavailableError
from torch import Tensor

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.fleet import FirstLeg, InstanceLost, RankedLeg, failover_for
from relaygr.cascade.proposals import RetrievalStage
from relaygr.cascade.request_path import RequestPath
from relaygr.cascade.stages import EarlierStages
from relaygr.cascade.store import HistoryStore
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.cascade.window import HistoryWindow
from relaygr.engine.transport.messages import (
    AbandonCall,
    ControlCall,
    PreinferCall,
    PreinferReply,
    RankCall,
    RankReply,
    ReplicaState,
    RouteNote,
)
from relaygr.engine.transport.payload import PrefixPayload
from relaygr.engine.types import PrefixSpec, RankJob, RankResult
from relaygr.errors import OverloadedError
from relaygr.kvcache import PrefixId
from relaygr.model import HSTU, HSTUConfig
from relaygr.routing import RouteDecision, RouteReason
from relaygr.server.backend import PrefillOutcome
from relaygr.server.snapshot import InstanceSnapshot, ServingCounters, ServingSnapshot

log = logging.getLogger("relaygr.ingress")

# Errors that mean "the replica this leg went to is gone": answer from the next choice.
REPLICA_LOST = (RayActorError, ReplicaUnavailableError)


def _decision(user_id: int, note: RouteNote) -> RouteDecision:
    return RouteDecision(user_id, note.instance_id, 0, note.spilled, RouteReason(note.reason))


def _route_of(call: RankCall, user_id: int, instance: str) -> RouteDecision:
    """The decision that sent ``call`` to ``instance``, as the request router noted it (its
    reason ``failover`` when ``follow`` moved the leg off its first leg's replica)."""
    if call.note is None:       # not noted: a leg that was not moved
        reason = RouteReason.FOLLOWED if call.follow is not None else RouteReason.OWNER
        return RouteDecision(user_id, instance, 0, False, reason)
    return RouteDecision(user_id, instance, 0, call.note.spilled, RouteReason(call.note.reason))


def _routed_to(call: RankCall) -> str | None:
    """The replica the request router sent ``call`` to (its ``note``), or was told to follow."""
    return call.note.instance_id if call.note is not None else \
        call.follow.instance_id if call.follow is not None else None


class ReplicaFleet:
    """``cascade.fleet.Fleet`` over the ranking deployment: each leg is one routed call (its
    user id, ``follow`` and ``avoid`` are what Serve's request router reads), and every reply
    brings the replica's snapshot (``snapshots``, for /metrics)."""

    def __init__(self, ranker: Any, max_attempts: int = 4) -> None:
        self.ranker = ranker        # a DeploymentHandle of RankingReplica
        self._max_attempts = max_attempts
        self.snapshots: dict[str, InstanceSnapshot] = {}
        self._abandoning: set[asyncio.Future[None]] = set()

    @property
    def max_attempts(self) -> int:
        return self._max_attempts

    def abandon(self, request_id: str, first: FirstLeg, pid: PrefixId) -> None:
        """Sent to the replica that got the signal (``target``; one that left is answered by
        another, which holds nothing of ``pid``); its answer is not awaited."""
        if first.instance is None or first.shed or first.lost:
            return
        task = asyncio.ensure_future(self._abandon(AbandonCall(
            request_id=request_id, user_id=pid.user_id, pid=pid, target=first.instance)))
        self._abandoning.add(task)
        task.add_done_callback(self._abandoning.discard)

    async def _abandon(self, call: AbandonCall) -> None:
        try:
            await self.ranker.abandon.remote(call)
        except Exception:      # advisory: the lease still ends on its own
            log.debug("abandoning %s on %s raised", call.pid, call.target, exc_info=True)

    def unhealthy(self) -> tuple[str, ...]:
        """The replicas whose last snapshot says they are not healthy: legs avoid them."""
        return tuple(name for name, snap in self.snapshots.items() if not snap.healthy)

    def preinfer(self, request_id: str, user_id: int, spec: PrefixSpec, suffix_tokens: int,
                 candidates: int, send: bool) -> FirstLeg | asyncio.Future[FirstLeg]:
        if not send:
            return FirstLeg(None)   # the second leg is routed when it is sent
        return asyncio.ensure_future(self._preinfer(PreinferCall(
            request_id=request_id, user_id=user_id, prefix=PrefixPayload.of(spec),
            suffix_tokens=suffix_tokens, candidates=candidates, avoid=self.unhealthy())))

    async def _preinfer(self, call: PreinferCall) -> FirstLeg:
        assert call.user_id is not None
        try:
            reply: PreinferReply = await self.ranker.preinfer.remote(call)
        except REPLICA_LOST:
            return FirstLeg(None, lost=True)
        route = None if reply.note is None else _decision(call.user_id, reply.note)
        return FirstLeg(route, reply.instance, reply.result, shed=reply.shed)

    async def rank(self, request_id: str, user_id: int, first: RouteDecision | None,
                   job: RankJob, avoid: tuple[str, ...]) -> RankedLeg:
        follow = None if first is None or avoid else \
            RouteNote(first.instance_id, first.reason.value, first.spilled)
        # A followed replica that has turned unhealthy since: the router moves the leg on.
        unhealthy = tuple(r for r in self.unhealthy() if r not in avoid)
        call = RankCall.of(job, request_id=request_id, user_id=user_id, follow=follow,
                           avoid=avoid + unhealthy)
        try:
            reply: RankReply = await self.ranker.rank.remote(call)
        except REPLICA_LOST as exc:
            lost = _routed_to(call)
            if lost is not None:
                self.snapshots.pop(lost, None)
            raise InstanceLost(lost) from exc
        except RayTaskError as exc:     # the replica's call raised: whose fault is it?
            failover = failover_for(_routed_to(call), exc.cause)
            if failover is None:
                raise
            raise failover from exc
        assert reply.snapshot is not None, "a replica's reply carries its snapshot"
        self.snapshots[reply.instance] = reply.snapshot
        if reply.overloaded_retry_s is not None:
            raise OverloadedError(reply.detail, reply.overloaded_retry_s)
        assert reply.path is not None
        return RankedLeg(RankResult(reply.tensor(), reply.path, reply.instance, reply.timing),
                         _route_of(call, user_id, reply.instance))

    async def refresh(self, method: str = "state") -> list[ReplicaState]:
        """Ask every replica known so far (or any one, before the first answer) for its state."""
        targets: list[str | None] = list(self.snapshots) or [None]
        states = await asyncio.gather(*[
            getattr(self.ranker, method).remote(ControlCall(request_id="control", target=t,
                                                            op=method))
            for t in targets], return_exceptions=True)
        out = []
        for target, state in zip(targets, states, strict=True):
            if isinstance(state, ReplicaState):
                if target is not None and state.replica != target:
                    self.snapshots.pop(target, None)     # it left; another replica answered
                self.snapshots[state.replica] = state.snapshot
                out.append(state)
            elif target is not None and isinstance(state, REPLICA_LOST):
                self.snapshots.pop(target, None)
            elif isinstance(state, BaseException):
                raise state
        return out


class RayBackend:
    """``RelayBackend`` over a Ray Serve ranking deployment (see the module docstring)."""

    def __init__(self, ranker: Any, model: HSTU, store: HistoryStore, system: SystemConfig,
                 max_attempts: int = 4, retrieval: RetrievalStage | None = None,
                 refresh_interval_s: float = 1.0) -> None:
        """``retrieval``: the retrieval stage, run here in the ingress (default: the model's
        item embeddings; ``EarlierStages.of``). ``refresh_interval_s``: how often every known
        replica is asked for its state (see the module docstring): a dead replica leaves
        /metrics and /readyz within it."""
        self.refresh_interval_s = refresh_interval_s
        self._refresher: asyncio.Task[None] | None = None
        self.model = model.eval()
        self.system = system
        self.fleet = ReplicaFleet(ranker, max_attempts)
        self.stages = EarlierStages.of(system, self.model, retrieval)
        self.path = RequestPath(self.fleet, system, store,
                                HistoryWindow.for_model(model.cfg, system), self.stages)

    # ---- RelayBackend ------------------------------------------------------------------------
    @property
    def model_config(self) -> HSTUConfig:
        return self.model.cfg

    @property
    def system_config(self) -> SystemConfig:
        return self.system

    @property
    def store(self) -> HistoryStore:
        return self.path.store

    async def start(self) -> None:
        await self.fleet.refresh()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_every())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        self.stages.shutdown()

    async def _refresh_every(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.fleet.refresh()
            except Exception as exc:  # the last snapshots stay; the next round asks again
                log.warning("refreshing the replicas' snapshots failed: %r", exc)

    async def recommend(self, visit: Visit) -> Recommendation:
        return await self.path.recommend(visit)

    async def prefill(self, user_id: int, suffix_tokens: int,
                      num_candidates: int | None) -> PrefillOutcome:
        return PrefillOutcome(*await self.path.prefill(user_id, suffix_tokens, num_candidates))

    async def rank(self, visit: Visit, candidates: Tensor) -> Recommendation:
        return await self.path.rank_candidates(visit, candidates)

    def append_events(self, user_id: int, items: Sequence[int],
                      timestamps: Sequence[int] | None,
                      expected_events: int | None = None) -> int:
        return self.path.append_events(user_id, items, timestamps, expected_events)

    def snapshot(self) -> ServingSnapshot:
        c, snapshots = self.path.counters, self.fleet.snapshots
        return ServingSnapshot(tuple(snapshots[name] for name in sorted(snapshots)),
                               ServingCounters(c.requests, c.failovers, c.shed_preinfer,
                                               c.shed_rank, self.path.remembered_prefills,
                                               window_slides=c.window_slides,
                                               windowed_requests=c.windowed_requests,
                                               lost_preinfer=c.lost_preinfer,
                                               instance_errors=c.instance_errors))

    async def quiesce(self) -> None:
        await self.fleet.refresh("quiesce")
