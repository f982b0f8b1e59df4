"""A relay system: the cascade over K ranking instances, in one process (the embedded default).

``recommend(visit)`` runs one request end to end (DESIGN.md section 2):

    history ─► router.route ─► instance.preinfer (trigger; returns at once) ──┐ first leg
            └► retrieval ─► pre-processing (own fleets; measured, ≥ set delays)      │
               ─► router.follow (same instance unless it failed) ─► instance.rank ◄─┘ second leg
               ─► the visit's events are appended to the history (new prefix version)

The prefix is the part of the user's history the model reads: its newest events, in a window
that slides in blocks once the history outgrows the model (``cascade.window``: what is reused
between slides, what is recomputed at one). The counters count the slides.

An instance that fails mid-request is skipped: the ranking leg goes to the user's next healthy
choice (which recomputes), so every request gets an answer and only its latency suffers.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.modes import Mode, spec_for
from relaygr.cascade.proposals import EmbeddingRetrieval, RetrievalStage
from relaygr.cascade.stages import CandidateBook, EarlierStages, StageTiming
from relaygr.cascade.store import HistoryStore
from relaygr.cascade.supervisor import InstanceSupervisor
from relaygr.cascade.window import HistoryWindow
from relaygr.engine.handle import InstanceHandle
from relaygr.engine.instance import InstanceConfig, RankingInstance
from relaygr.engine.scheduler import BatchPolicy, InstanceStoppedError
from relaygr.engine.types import (
    PrefixSpec,
    PreinferAction,
    PreinferResult,
    RankJob,
    RankPath,
    RankResult,
    RankTiming,
)
from relaygr.errors import NoHealthyInstanceError, OverloadedError
from relaygr.model import HSTU
from relaygr.relay.costmodel import LatencyCostModel
from relaygr.relay.trigger import TriggerConfig, make_trigger
from relaygr.routing import InstanceView, RouteDecision, make_router

# Prefill signals whose ranking leg has not come yet; a caller that never ranks costs this much.
_MAX_REMEMBERED_DECISIONS = 100_000

# Builds instance ``name`` on ``device`` for a system config (``build_instance`` in this process,
# ``InstanceProcesses.factory`` in processes of their own).
InstanceFactory = Callable[[SystemConfig, str, str, HSTU, LatencyCostModel], InstanceHandle]


@dataclass(frozen=True)
class Visit:
    """One request: a user, the behaviours since their last visit, and the request time."""

    user_id: int
    recent_items: tuple[int, ...] = ()
    recent_timestamps: tuple[int, ...] | None = None
    request_ts: int | None = None
    num_candidates: int | None = None     # None: the system's default


@dataclass(frozen=True)
class Recommendation:
    """Candidates (best retrieval order) and their ranking scores, with how they were made."""

    candidates: Tensor
    scores: Tensor
    path: RankPath
    instance: str                  # the instance that ranked
    preinfer: PreinferResult | None
    preinfer_instance: str | None  # the instance that got the pre-infer signal
    prefix_tokens: int
    suffix_tokens: int
    ranking_due_s: float       # time.perf_counter() when ranking was due
    ranking_done_s: float
    timing: RankTiming | None = None   # inside the ranking instance (None: not reported)
    window_start: int = 0      # the history event the model read first (cascade.window)
    stages: StageTiming | None = None  # retrieval and delays before ranking (None: no stages)


@dataclass
class SystemCounters:
    requests: int = 0
    failovers: int = 0
    shed_preinfer: int = 0
    shed_rank: int = 0
    paths: Counter[str] = field(default_factory=Counter)
    window_slides: int = 0       # appends that moved a user's window (its cache is recomputed)
    windowed_requests: int = 0   # ranked from a window that starts after the first event


@dataclass
class _Leg:
    """A request between its two legs: the routed prefix and the pre-infer outcome."""

    visit: Visit
    spec: PrefixSpec
    history_items: np.ndarray
    num_candidates: int
    decision: RouteDecision
    preinfer: PreinferResult | Awaitable[PreinferResult] | None = None

    async def preinfer_result(self) -> PreinferResult | None:
        """The pre-infer outcome (an instance in another process reports it asynchronously)."""
        if inspect.isawaitable(self.preinfer):
            self.preinfer = await self.preinfer
        return self.preinfer


class RelaySystem:
    """See the module docstring. One event loop drives it."""

    def __init__(self, config: SystemConfig, model: HSTU, store: HistoryStore,
                 cost_model: LatencyCostModel, retrieval: RetrievalStage | None = None,
                 book: CandidateBook | None = None,
                 instance_factory: InstanceFactory | None = None) -> None:
        """``retrieval``: the retrieval stage's strategy (default: the model's item embeddings,
        ``EmbeddingRetrieval``)."""
        self.config = config
        self.mode = Mode.parse(config.mode)
        self.spec = spec_for(self.mode)
        self.model = model.eval()
        self.store = store
        self.window = HistoryWindow.for_model(model.cfg, config)
        router_options = dict(self.spec.router_options)
        if self.spec.router == "affinity":
            router_options.setdefault("spill_queue_depth", config.spill_queue_depth)
        self.router = make_router(self.spec.router, **router_options)
        make = instance_factory or build_instance
        self.instances: list[InstanceHandle] = [
            make(config, f"rank-{i}", config.devices[i % len(config.devices)], self.model,
                 cost_model) for i in range(config.num_instances)]
        self.by_name = {inst.name: inst for inst in self.instances}
        # restarts instances whose process died (instances in processes; others never die)
        self.supervisor = InstanceSupervisor(self.instances)
        self.stages = EarlierStages(
            retrieval or EmbeddingRetrieval.of(model, config.retrieval_history),
            config.retrieval_k, config.retrieval_delay_ms / 1e3,
            config.preprocess_delay_ms / 1e3, book)
        self.counters = SystemCounters()
        # prefill signal -> the decision its ranking leg follows (bounded: oldest dropped)
        self._decisions: OrderedDict[int, RouteDecision] = OrderedDict()

    async def start(self) -> None:
        for inst in self.instances:
            await inst.start()
        self.supervisor.start()

    async def stop(self) -> None:
        await self.supervisor.stop()
        for inst in self.instances:
            await inst.stop()
        self.stages.shutdown()

    @property
    def remembered_prefills(self) -> int:
        """Pre-infer signals (``prefill``) whose ranking leg has not come yet."""
        return len(self._decisions)

    def views(self) -> list[InstanceView]:
        return [InstanceView(i.name, i.healthy, i.queue_depth) for i in self.instances]

    # ---- one request -------------------------------------------------------------------------
    def _prefix_spec(self, user_id: int, suffix_tokens: int) -> tuple[PrefixSpec, np.ndarray]:
        """The window's prefix a visit adding ``suffix_tokens`` events reads, and the user's
        whole history (what retrieval excludes)."""
        prefix = self.window.prefix(self.store, user_id, suffix_tokens)
        ts = None if prefix.timestamps is None else torch.tensor(prefix.timestamps)
        start = prefix.window_start
        spec = PrefixSpec(prefix.pid, torch.tensor(prefix.items), ts,
                          lambda n: self.store.version_at(user_id, start + n, start), start)
        return spec, self.store.get(user_id).items

    async def recommend(self, visit: Visit) -> Recommendation:
        """The whole cascade for one visit: retrieval, pre-processing and relayed ranking."""
        leg = self._first_leg(visit, preinfer=True)
        seen = np.concatenate([leg.history_items,
                               np.asarray(visit.recent_items, dtype=np.int64)])
        earlier = await self.stages.run(seen, leg.num_candidates, visit.user_id)
        return await self._second_leg(leg, earlier.candidates, earlier.timing)

    async def prefill(self, user_id: int, suffix_tokens: int = 0,
                      num_candidates: int | None = None) -> tuple[str, PreinferResult]:
        """The pre-infer signal alone (for callers that run their own earlier stages). The
        routing decision is remembered so the user's next ``rank_candidates`` follows it."""
        leg = self._first_leg(Visit(user_id, num_candidates=num_candidates), preinfer=True,
                              suffix_tokens=suffix_tokens)
        self._decisions[user_id] = leg.decision
        self._decisions.move_to_end(user_id)
        while len(self._decisions) > _MAX_REMEMBERED_DECISIONS:
            self._decisions.popitem(last=False)
        result = await leg.preinfer_result()
        assert result is not None
        return leg.decision.instance_id, result

    async def rank_candidates(self, visit: Visit, candidates: Tensor) -> Recommendation:
        """Rank given candidates for a visit, consuming the relayed prefix when present."""
        leg = self._first_leg(visit, preinfer=False)
        leg.decision = self._decisions.pop(visit.user_id, leg.decision)
        return await self._second_leg(leg, candidates.to(torch.int64))

    def append_events(self, user_id: int, items: Sequence[int],
                      timestamps: Sequence[int] | None = None) -> int:
        """Append behaviour events (the prefix version changes); returns the new length."""
        before = self.store.num_events(user_id) if user_id in self.store else 0
        after = self.store.append(user_id, items, timestamps).num_events
        self.counters.window_slides += int(before > 0 and self.window.slid(before, after))
        return after

    def _first_leg(self, visit: Visit, preinfer: bool, suffix_tokens: int | None = None
                   ) -> _Leg:
        s = len(visit.recent_items) if suffix_tokens is None else suffix_tokens
        spec, history_items = self._prefix_spec(visit.user_id, s)
        n_cand = visit.num_candidates or self.config.num_candidates
        decision = self.router.route(visit.user_id, self.views())
        instance = self.by_name[decision.instance_id]
        leg = _Leg(visit, spec, history_items, n_cand, decision)
        if preinfer and self.spec.preinfer:
            if instance.rank_queue_depth >= self.config.shed_preinfer_queue_depth:
                leg.preinfer = PreinferResult(PreinferAction.SKIPPED, None, 0)
                self.counters.shed_preinfer += 1
            else:
                leg.preinfer = instance.preinfer(spec, s, n_cand)
        return leg

    async def _second_leg(self, leg: _Leg, candidates: Tensor,
                          stages: StageTiming | None = None) -> Recommendation:
        visit, spec = leg.visit, leg.spec
        suffix = suffix_ts = None
        grown = None
        if visit.recent_items:
            suffix = torch.tensor(visit.recent_items, dtype=torch.int64)
            if visit.recent_timestamps is not None:
                suffix_ts = torch.tensor(visit.recent_timestamps, dtype=torch.int64)
            grown = self.window.grown(self.store, spec.pid, spec.window_start,
                                      visit.recent_items, visit.recent_timestamps)
        job = RankJob(spec, candidates, suffix, suffix_ts, visit.request_ts, grown)
        due = time.perf_counter()
        result = await self._rank(leg.decision, job)
        done = time.perf_counter()
        if visit.recent_items:
            self.append_events(visit.user_id, visit.recent_items, visit.recent_timestamps)
        self.counters.requests += 1
        self.counters.windowed_requests += int(spec.window_start > 0)
        self.counters.paths[result.path.value] += 1
        return Recommendation(candidates, result.scores, result.path, result.instance,
                              await leg.preinfer_result(),
                              leg.decision.instance_id if leg.preinfer is not None else None,
                              spec.num_tokens, job.suffix_tokens, due, done, result.timing,
                              spec.window_start, stages)

    async def _rank(self, first: RouteDecision, job: RankJob) -> RankResult:
        decision = self.router.follow(first, self.views())
        for _ in range(len(self.instances)):
            instance = self.by_name[decision.instance_id]
            if instance.rank_queue_depth >= self.config.max_rank_queue_depth:
                self.counters.shed_rank += 1
                raise OverloadedError(f"{instance.name} has {instance.rank_queue_depth} ranking "
                                      "requests queued",
                                      retry_after_s=max(0.1, self.config.slo_ms / 1e3))
            try:
                return await instance.rank(job)
            except InstanceStoppedError:
                self.counters.failovers += 1
                decision = self.router.follow(decision, self.views())
        raise NoHealthyInstanceError("no healthy ranking instance answered")

    # ---- fault injection ---------------------------------------------------------------------
    async def fail_instance(self, name: str) -> None:
        await self.by_name[name].fail()

    async def restart_instance(self, name: str) -> None:
        await self.by_name[name].restart()

    async def wait_idle(self) -> None:
        """Wait for background work (pre-infer, demotion, fills) of every instance to end."""
        await asyncio.gather(*(inst.idle() for inst in self.instances))


def build_instance(config: SystemConfig, name: str, device: str, model: HSTU,
                   cost_model: LatencyCostModel) -> RankingInstance:
    """One ranking instance as ``config``'s mode wants it (trigger, tiers, budgets, batching).

    The embedded system builds its K instances with it, and a Ray Serve replica builds its one
    instance with it, so both run the same instance logic.
    """
    spec = spec_for(Mode.parse(config.mode))
    trigger = None
    if spec.trigger is not None:
        trigger = make_trigger(spec.trigger, cost_model, TriggerConfig(
            slo_ms=config.slo_ms, risk_fraction=config.risk_fraction,
            max_pool_fraction=config.max_pool_fraction,
            max_preinfer_tokens_per_s=config.max_preinfer_tokens_per_s,
            burst_tokens=config.burst_tokens))
    return RankingInstance(InstanceConfig(
        name=name, device=device,
        device_budget_bytes=config.device_budget_bytes if spec.device_cache else 0,
        host_budget_bytes=config.host_budget_bytes if spec.host_tier else 0,
        page_tokens=config.page_tokens, lease_s=config.lease_s, host_ttl_s=config.host_ttl_s,
        batch=BatchPolicy(max_requests=config.batch_max_requests),
        truncate_to_tokens=config.truncate_to_tokens,
        cross_request_reuse=config.cross_request_reuse), model.eval(), trigger)
