"""The Ray ingress: the cascade (history store, retrieval, pre-processing) and the HTTP API.

``RayBackend`` is the ``RelayBackend`` of the Ray topology. Per visit it sends the first leg
(``PreinferCall``) to the ranking deployment as the visit arrives, runs the earlier stages here
meanwhile, then sends the second leg (``RankCall``) with ``follow`` set to the replica that took
the first, so Serve's request router (``RelayRequestRouter``) sends both legs of the request to
the replica that owns the user. The ingress appends the visit's events to the store after
ranking, as the embedded system does, and reads the same history window (``cascade.window``).

Fallbacks: a lost pre-infer leg only costs the relay (ranking recomputes); a ranking leg whose
replica died is sent again with that replica in ``avoid`` (the user's next choice, which
recomputes), up to ``max_attempts`` times. A replica that sheds answers overloaded, and the
request gets 503.

``RelayIngress`` is the Serve deployment class: it builds the model (and checks its digest),
the store and a ``RelayService`` over a ``RayBackend``, and serves ``create_app`` of it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from torch import Tensor

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.modes import Mode, spec_for
from relaygr.cascade.proposals import EmbeddingRetrieval
from relaygr.cascade.stages import EarlierStages
from relaygr.cascade.store import HistoryStore
from relaygr.cascade.system import Recommendation, Visit
from relaygr.cascade.window import HistoryWindow
from relaygr.distributed.calls import (
    ControlCall,
    PrefixPayload,
    PreinferCall,
    PreinferReply,
    RankCall,
    RankReply,
    ReplicaState,
    RouteNote,
)
from relaygr.errors import NoHealthyInstanceError, OverloadedError
from relaygr.model import HSTU, HSTUConfig
from relaygr.server.backend import PrefillOutcome
from relaygr.server.snapshot import InstanceSnapshot, ServingCounters, ServingSnapshot

# Errors that mean "the replica this leg went to is gone": answer from the next choice.
REPLICA_LOST = (RayActorError, ReplicaUnavailableError)
_MAX_REMEMBERED_DECISIONS = 100_000


@dataclass
class _Counters:
    requests: int = 0
    failovers: int = 0
    shed_preinfer: int = 0
    shed_rank: int = 0
    lost_preinfer: int = 0
    window_slides: int = 0
    windowed_requests: int = 0


class RayBackend:
    """``RelayBackend`` over a Ray Serve ranking deployment (see the module docstring)."""

    def __init__(self, ranker: Any, model: HSTU, store: HistoryStore, system: SystemConfig,
                 max_attempts: int = 4) -> None:
        self.ranker = ranker        # a DeploymentHandle of RankingReplica
        self.model = model.eval()
        self._store = store
        self.system = system
        self.window = HistoryWindow.for_model(model.cfg, system)
        self.max_attempts = max_attempts
        self.stages = EarlierStages(EmbeddingRetrieval.of(model, system.retrieval_history),
                                    system.retrieval_k, system.retrieval_delay_ms / 1e3,
                                    system.preprocess_delay_ms / 1e3)
        self.preinfers = spec_for(Mode.parse(system.mode)).preinfer
        self.counters = _Counters()
        self.snapshots: dict[str, InstanceSnapshot] = {}
        self._decisions: OrderedDict[int, RouteNote] = OrderedDict()

    # ---- RelayBackend ------------------------------------------------------------------------
    @property
    def model_config(self) -> HSTUConfig:
        return self.model.cfg

    @property
    def system_config(self) -> SystemConfig:
        return self.system

    @property
    def store(self) -> HistoryStore:
        return self._store

    async def start(self) -> None:
        await self.refresh()

    async def stop(self) -> None:
        self.stages.shutdown()

    async def recommend(self, visit: Visit) -> Recommendation:
        request_id = uuid.uuid4().hex
        prefix = self._prefix(visit.user_id, len(visit.recent_items))
        n_cand = visit.num_candidates or self.system.num_candidates
        first = asyncio.ensure_future(self._preinfer(PreinferCall(
            request_id=request_id, user_id=visit.user_id, prefix=prefix,
            suffix_tokens=len(visit.recent_items), candidates=n_cand)))
        seen = np.concatenate([self._store.get(visit.user_id).items,
                               np.asarray(visit.recent_items, dtype=np.int64)])
        try:
            earlier = await self.stages.run(seen, n_cand)
        finally:
            pre = await first
        rec = await self._second_leg(request_id, visit, prefix, earlier.candidates, pre,
                                     None if pre is None else pre.note)
        return replace(rec, stages=earlier.timing)

    async def prefill(self, user_id: int, suffix_tokens: int,
                      num_candidates: int | None) -> PrefillOutcome:
        pre = await self._preinfer(PreinferCall(
            request_id=uuid.uuid4().hex, user_id=user_id,
            prefix=self._prefix(user_id, suffix_tokens),
            suffix_tokens=suffix_tokens,
            candidates=num_candidates or self.system.num_candidates))
        if pre is None:
            raise NoHealthyInstanceError("the pre-infer signal found no live ranking replica")
        if pre.note is not None:
            self._decisions[user_id] = pre.note
            self._decisions.move_to_end(user_id)
            while len(self._decisions) > _MAX_REMEMBERED_DECISIONS:
                self._decisions.popitem(last=False)
        return PrefillOutcome(pre.replica, pre.result)

    async def rank(self, visit: Visit, candidates: Tensor) -> Recommendation:
        prefix = self._prefix(visit.user_id, len(visit.recent_items))
        follow = self._decisions.pop(visit.user_id, None)
        return await self._second_leg(uuid.uuid4().hex, visit, prefix,
                                      candidates.to(torch.int64), None, follow)

    def append_events(self, user_id: int, items: Sequence[int],
                      timestamps: Sequence[int] | None) -> int:
        before = self._store.num_events(user_id) if user_id in self._store else 0
        after = self._store.append(user_id, items, timestamps).num_events
        self.counters.window_slides += int(before > 0 and self.window.slid(before, after))
        return after

    def snapshot(self) -> ServingSnapshot:
        c = self.counters
        return ServingSnapshot(tuple(self.snapshots[name] for name in sorted(self.snapshots)),
                               ServingCounters(c.requests, c.failovers, c.shed_preinfer,
                                               c.shed_rank, len(self._decisions),
                                               window_slides=c.window_slides,
                                               windowed_requests=c.windowed_requests))

    async def quiesce(self) -> None:
        await self.refresh("quiesce")

    async def refresh(self, method: str = "state") -> list[ReplicaState]:
        """Ask every replica known so far (or any one, before the first answer) for its state."""
        targets: list[str | None] = list(self.snapshots) or [None]
        states = await asyncio.gather(*[
            getattr(self.ranker, method).remote(ControlCall(request_id="control", target=t))
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

    # ---- the two legs ------------------------------------------------------------------------
    def _prefix(self, user_id: int, suffix_tokens: int) -> PrefixPayload:
        return self.window.prefix(self._store, user_id, suffix_tokens)

    async def _preinfer(self, call: PreinferCall) -> PreinferReply | None:
        if not self.preinfers:
            return None             # modes without pre-inference send no first leg
        try:
            reply: PreinferReply = await self.ranker.preinfer.remote(call)
        except REPLICA_LOST:
            self.counters.lost_preinfer += 1
            return None
        self.counters.shed_preinfer += int(reply.shed)
        return reply

    async def _second_leg(self, request_id: str, visit: Visit, prefix: PrefixPayload,
                          candidates: Tensor, pre: PreinferReply | None,
                          follow: RouteNote | None) -> Recommendation:
        call = RankCall(request_id=request_id, user_id=visit.user_id, follow=follow,
                        prefix=prefix, candidates=candidates, query_ts=visit.request_ts)
        if visit.recent_items:
            call.suffix_items = torch.tensor(visit.recent_items, dtype=torch.int64)
            if visit.recent_timestamps is not None:
                call.suffix_timestamps = torch.tensor(visit.recent_timestamps,
                                                      dtype=torch.int64)
            call.grown = self.window.grown(self._store, prefix.pid, prefix.window_start,
                                           visit.recent_items, visit.recent_timestamps)
        due = time.perf_counter()
        reply = await self._rank(call)
        done = time.perf_counter()
        if visit.recent_items:
            self.append_events(visit.user_id, visit.recent_items, visit.recent_timestamps)
        assert reply.scores is not None and reply.path is not None
        self.counters.requests += 1
        self.counters.windowed_requests += int(prefix.window_start > 0)
        return Recommendation(candidates, reply.scores, reply.path, reply.replica,
                              None if pre is None else pre.result,
                              None if pre is None else pre.replica, prefix.pid.num_tokens,
                              0 if call.suffix_items is None else len(visit.recent_items),
                              due, done, window_start=prefix.window_start)

    async def _rank(self, call: RankCall) -> RankReply:
        for _ in range(self.max_attempts):
            try:
                reply: RankReply = await self.ranker.rank.remote(call)
            except REPLICA_LOST:
                lost = call.note.instance_id if call.note is not None else \
                    call.follow.instance_id if call.follow is not None else None
                self.counters.failovers += 1
                if lost is not None:
                    self.snapshots.pop(lost, None)
                avoid = call.avoid + ((lost,) if lost is not None else ())
                call = replace(call, follow=None, avoid=avoid, note=None)
                continue
            self.snapshots[reply.replica] = reply.snapshot
            if reply.overloaded_retry_s is not None:
                self.counters.shed_rank += 1
                raise OverloadedError(reply.detail, reply.overloaded_retry_s)
            return reply
        raise NoHealthyInstanceError(f"ranking failed on {self.max_attempts} replicas in turn")
