"""A relay system: the cascade over K ranking instances, in one process (the embedded default).

``recommend(visit)`` runs one request end to end (DESIGN.md section 2):

    history ─► router.route ─► instance.preinfer (trigger; returns at once) ──┐ first leg
            └► retrieval ─► pre-processing (their own fleets, ≥ configured delays)   │
               ─► router.follow (same instance unless it failed) ─► instance.rank ◄─┘ second leg
               ─► the visit's events are appended to the history (new prefix version)

An instance that fails mid-request is skipped: the ranking leg goes to the user's next healthy
choice (which recomputes), so every request gets an answer and only its latency suffers.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.modes import Mode, spec_for
from relaygr.cascade.retrieval import Retriever
from relaygr.cascade.stages import EarlierStages
from relaygr.cascade.store import HistoryStore
from relaygr.engine.instance import InstanceConfig, RankingInstance
from relaygr.engine.scheduler import BatchPolicy, InstanceStoppedError
from relaygr.engine.types import PrefixSpec, PreinferResult, RankJob, RankPath, RankResult
from relaygr.errors import InvalidInputError, NoHealthyInstanceError
from relaygr.kvcache import PrefixId
from relaygr.model import HSTU
from relaygr.relay.costmodel import LatencyCostModel
from relaygr.relay.trigger import TriggerConfig, make_trigger
from relaygr.routing import InstanceView, RouteDecision, make_router


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


@dataclass
class SystemCounters:
    requests: int = 0
    failovers: int = 0
    paths: Counter[str] = field(default_factory=Counter)


class RelaySystem:
    """See the module docstring. One event loop drives it."""

    def __init__(self, config: SystemConfig, model: HSTU, store: HistoryStore,
                 cost_model: LatencyCostModel, retriever: Retriever | None = None) -> None:
        self.config = config
        self.mode = Mode.parse(config.mode)
        self.spec = spec_for(self.mode)
        self.model = model.eval()
        self.store = store
        router_options = dict(self.spec.router_options)
        if self.spec.router == "affinity":
            router_options.setdefault("spill_queue_depth", config.spill_queue_depth)
        self.router = make_router(self.spec.router, **router_options)
        self.instances = [self._instance(i, cost_model) for i in range(config.num_instances)]
        self.by_name = {inst.name: inst for inst in self.instances}
        self.stages = EarlierStages(model, retriever or Retriever.from_model(model),
                                    config.retrieval_k, config.retrieval_history,
                                    config.retrieval_delay_ms / 1e3,
                                    config.preprocess_delay_ms / 1e3)
        self.counters = SystemCounters()

    def _instance(self, index: int, cost_model: LatencyCostModel) -> RankingInstance:
        cfg = self.config
        trigger = None
        if self.spec.trigger is not None:
            trigger = make_trigger(self.spec.trigger, cost_model, TriggerConfig(
                slo_ms=cfg.slo_ms, risk_fraction=cfg.risk_fraction,
                max_pool_fraction=cfg.max_pool_fraction,
                max_preinfer_tokens_per_s=cfg.max_preinfer_tokens_per_s,
                burst_tokens=cfg.burst_tokens))
        return RankingInstance(InstanceConfig(
            name=f"rank-{index}", device=cfg.devices[index % len(cfg.devices)],
            device_budget_bytes=cfg.device_budget_bytes if self.spec.device_cache else 0,
            host_budget_bytes=cfg.host_budget_bytes if self.spec.host_tier else 0,
            page_tokens=cfg.page_tokens, lease_s=cfg.lease_s, host_ttl_s=cfg.host_ttl_s,
            batch=BatchPolicy(max_requests=cfg.batch_max_requests),
            truncate_to_tokens=cfg.truncate_to_tokens), self.model, trigger)

    async def start(self) -> None:
        for inst in self.instances:
            await inst.start()

    async def stop(self) -> None:
        for inst in self.instances:
            await inst.stop()
        self.stages.shutdown()

    def views(self) -> list[InstanceView]:
        return [InstanceView(i.name, i.healthy, i.queue_depth) for i in self.instances]

    # ---- one request -------------------------------------------------------------------------
    def _prefix_spec(self, user_id: int) -> tuple[PrefixSpec, np.ndarray]:
        history = self.store.get(user_id)
        if history.num_events == 0:
            raise InvalidInputError(f"user {user_id} has an empty history")
        ts = None if history.timestamps is None else torch.tensor(history.timestamps)
        spec = PrefixSpec(PrefixId(user_id, history.num_events, history.version),
                          torch.tensor(history.items), ts,
                          lambda n: self.store.version_at(user_id, n))
        return spec, history.items

    async def recommend(self, visit: Visit) -> Recommendation:
        spec, history_items = self._prefix_spec(visit.user_id)
        n_cand = visit.num_candidates or self.config.num_candidates
        suffix = torch.tensor(visit.recent_items, dtype=torch.int64) if visit.recent_items \
            else None
        suffix_ts = torch.tensor(visit.recent_timestamps, dtype=torch.int64) \
            if suffix is not None and visit.recent_timestamps is not None else None
        first = self.router.route(visit.user_id, self.views())
        preinfer = None
        if self.spec.preinfer:
            preinfer = self.by_name[first.instance_id].preinfer(
                spec, 0 if suffix is None else int(suffix.numel()), n_cand)
        seen = np.concatenate([history_items, np.asarray(visit.recent_items, dtype=np.int64)])
        candidates = await self.stages.run(seen, n_cand)
        grown = None
        if suffix is not None:
            grown = PrefixId(visit.user_id, spec.num_tokens + int(suffix.numel()),
                             self.store.version_after(visit.user_id, spec.num_tokens,
                                                      visit.recent_items,
                                                      visit.recent_timestamps))
        job = RankJob(spec, candidates, suffix, suffix_ts, visit.request_ts, grown)
        due = time.perf_counter()
        result = await self._rank(first, job)
        done = time.perf_counter()
        if visit.recent_items:
            self.store.append(visit.user_id, visit.recent_items, visit.recent_timestamps)
        self.counters.requests += 1
        self.counters.paths[result.path.value] += 1
        return Recommendation(candidates, result.scores, result.path, result.instance, preinfer,
                              first.instance_id if preinfer is not None else None,
                              spec.num_tokens, job.suffix_tokens, due, done)

    async def _rank(self, first: RouteDecision, job: RankJob) -> RankResult:
        decision = self.router.follow(first, self.views())
        for _ in range(len(self.instances)):
            try:
                return await self.by_name[decision.instance_id].rank(job)
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
        while True:
            pending = [t for i in self.instances if i.residency is not None
                       for t in i.residency.background]
            busy = any(i.queue_depth for i in self.instances)
            if not pending and not busy:
                return
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            else:
                await asyncio.sleep(0.001)
