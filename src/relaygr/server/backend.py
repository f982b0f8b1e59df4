"""What the HTTP layer drives: a ``RelayBackend``, one per serving topology.

``EmbeddedBackend`` is the relay system in this process (K in-process instances behind the
affinity router: ``relaygr.cascade.system.RelaySystem``). The Ray ingress implements the same
protocol over Ray Serve replicas (``relaygr.distributed.ingress``), so one FastAPI app, one
validation layer and one set of metrics serve both.

Contract: a backend is driven from one event loop; inputs reaching it have been validated
(``relaygr.server.validation``); it raises ``OverloadedError`` when it sheds a request and
``NoHealthyInstanceError`` when no instance can answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.store import HistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.engine.types import PreinferResult
from relaygr.model import HSTUConfig
from relaygr.server.snapshot import ServingCounters, ServingSnapshot


@dataclass(frozen=True)
class PrefillOutcome:
    """Where a pre-infer signal went and what it did there."""

    instance: str
    result: PreinferResult


class RelayBackend(Protocol):
    """The serving operations behind the HTTP API (see the module docstring)."""

    @property
    def model_config(self) -> HSTUConfig: ...

    @property
    def system_config(self) -> SystemConfig: ...

    @property
    def store(self) -> HistoryStore: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def recommend(self, visit: Visit) -> Recommendation: ...

    async def prefill(self, user_id: int, suffix_tokens: int,
                      num_candidates: int | None) -> PrefillOutcome: ...

    async def rank(self, visit: Visit, candidates: Tensor) -> Recommendation: ...

    def append_events(self, user_id: int, items: Sequence[int],
                      timestamps: Sequence[int] | None,
                      expected_events: int | None = None) -> int: ...

    def snapshot(self) -> ServingSnapshot: ...

    async def quiesce(self) -> None:
        """Wait until no background work (pre-infer, demotion) is running (for tests)."""


class EmbeddedBackend:
    """``RelayBackend`` over a ``RelaySystem`` in this process."""

    def __init__(self, system: RelaySystem, on_stop: Callable[[], None] | None = None) -> None:
        self.system = system
        self._on_stop = on_stop       # what else the system's parts need ended (processes)

    @property
    def model_config(self) -> HSTUConfig:
        return self.system.model.cfg

    @property
    def system_config(self) -> SystemConfig:
        return self.system.config

    @property
    def store(self) -> HistoryStore:
        return self.system.store

    async def start(self) -> None:
        await self.system.start()

    async def stop(self) -> None:
        try:
            await self.system.stop()
        finally:
            if self._on_stop is not None:
                self._on_stop()     # on the loop: it closes the loop's own streams

    async def recommend(self, visit: Visit) -> Recommendation:
        return await self.system.recommend(visit)

    async def prefill(self, user_id: int, suffix_tokens: int,
                      num_candidates: int | None) -> PrefillOutcome:
        instance, result = await self.system.prefill(user_id, suffix_tokens, num_candidates)
        return PrefillOutcome(instance, result)

    async def rank(self, visit: Visit, candidates: Tensor) -> Recommendation:
        return await self.system.rank_candidates(visit, candidates)

    def append_events(self, user_id: int, items: Sequence[int],
                      timestamps: Sequence[int] | None,
                      expected_events: int | None = None) -> int:
        return self.system.append_events(user_id, items, timestamps, expected_events)

    def snapshot(self) -> ServingSnapshot:
        c = self.system.counters
        sup = self.system.supervisor.counts
        counters = ServingCounters(c.requests, c.failovers, c.shed_preinfer, c.shed_rank,
                                   self.system.remembered_prefills, sup.deaths, sup.restarts,
                                   len(sup.given_up), c.window_slides, c.windowed_requests,
                                   sup.hangs, c.lost_preinfer, sup.failed_restarts,
                                   instance_errors=c.instance_errors,
                                   breaker_opens=self.system.fleet.breaker_opens)
        return ServingSnapshot(self.system.fleet.snapshots(), counters)

    async def quiesce(self) -> None:
        await self.system.wait_idle()
