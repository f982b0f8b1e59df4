"""A relay system: the cascade over K ranking instances, in one process (the embedded default).

``RelaySystem`` owns the parts: the store and its history window, the earlier stages, the K
instances (``build_instance`` in this process, or an ``InstanceFactory`` that places them
elsewhere, e.g. worker processes: ``engine.transport.processes``), their supervisor, and the mode's
router. A request's path through them (window prefix, the two legs, shedding, failover,
appending the visit) is ``cascade.request_path.RequestPath``, the one the Ray ingress drives too;
here it reaches the instances through ``cascade.fleet.InstanceFleet``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from torch import Tensor

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.fleet import InstanceFleet
from relaygr.cascade.instances import InstanceFactory, build_instance
from relaygr.cascade.modes import Mode, spec_for
from relaygr.cascade.proposals import RetrievalStage
from relaygr.cascade.request_path import RequestPath
from relaygr.cascade.stages import CandidateBook, EarlierStages
from relaygr.cascade.store import HistoryStore
from relaygr.cascade.visit import Recommendation, SystemCounters, Visit
from relaygr.cascade.window import HistoryWindow
from relaygr.engine.handle import InstanceHandle
from relaygr.engine.transport.supervisor import InstanceSupervisor
from relaygr.engine.types import PreinferResult
from relaygr.model import HSTU
from relaygr.relay.costmodel import LatencyCostModel
from relaygr.routing import InstanceView, make_router


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
        self.router = make_router(self.spec.router, **self.spec.router_settings(config.affinity))
        make = instance_factory or build_instance
        self.instances: list[InstanceHandle] = [
            make(config, f"rank-{i}", config.devices[i % len(config.devices)], self.model,
                 cost_model) for i in range(config.num_instances)]
        self.by_name = {inst.name: inst for inst in self.instances}
        # restarts instances whose process died (instances in processes; others never die)
        self.supervisor = InstanceSupervisor(self.instances)
        self.stages = EarlierStages.of(config, self.model, retrieval, book)
        self.fleet = InstanceFleet(self.instances, self.router, config)
        self.path = RequestPath(self.fleet, config, store, self.window, self.stages)

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
    def counters(self) -> SystemCounters:
        return self.path.counters

    @property
    def remembered_prefills(self) -> int:
        """Pre-infer signals (``prefill``) whose ranking leg has not come yet."""
        return self.path.remembered_prefills

    def views(self) -> list[InstanceView]:
        return self.fleet.views()

    # ---- one request (``RequestPath``) -------------------------------------------------------
    async def recommend(self, visit: Visit) -> Recommendation:
        """The whole cascade for one visit: retrieval, pre-processing and relayed ranking."""
        return await self.path.recommend(visit)

    async def prefill(self, user_id: int, suffix_tokens: int = 0,
                      num_candidates: int | None = None) -> tuple[str, PreinferResult]:
        """The pre-infer signal alone; the user's next ``rank_candidates`` follows it."""
        return await self.path.prefill(user_id, suffix_tokens, num_candidates)

    async def rank_candidates(self, visit: Visit, candidates: Tensor) -> Recommendation:
        """Rank given candidates for a visit, consuming the relayed prefix when present."""
        return await self.path.rank_candidates(visit, candidates)

    def append_events(self, user_id: int, items: Sequence[int],
                      timestamps: Sequence[int] | None = None,
                      expected_events: int | None = None) -> int:
        """Append behaviour events (the prefix version changes); returns the new length.
        ``expected_events``: the append's precondition (``HistoryStore.append``)."""
        return self.path.append_events(user_id, items, timestamps, expected_events)

    # ---- fault injection ---------------------------------------------------------------------
    async def fail_instance(self, name: str) -> None:
        await self.by_name[name].fail()

    async def restart_instance(self, name: str) -> None:
        await self.by_name[name].restart()

    async def wait_idle(self) -> None:
        """Wait for background work (pre-infer, demotion, fills) of every instance to end."""
        await asyncio.gather(*(inst.idle() for inst in self.instances))
