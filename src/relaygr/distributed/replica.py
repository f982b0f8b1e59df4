"""A ranking replica: one ``RankingInstance`` (one accelerator) behind Ray Serve.

The replica is the embedded instance, unchanged: it builds its ``RankingInstance`` with the
cascade's ``build_instance`` (same trigger, tiers, budgets and scheduler as an in-process
instance) and answers the two legs of the relay:

* ``preinfer(PreinferCall)``: the instance's pre-infer signal, unless the cascade's shed rule
  (``cascade.fleet.sheds_preinfer``, the one the embedded fleet checks) skips it;
* ``rank(RankCall)``: the instance ranks (consuming the relayed prefix when it is here), unless
  ``cascade.fleet.rank_shed`` refuses it (then the reply says overloaded and the ingress
  answers 503).

Both are answered by ``cascade.instance_end.SheddingEnd``: the worker process's
``InstanceEnd`` with the shed rules applied here.

``check_health`` is Ray Serve's health check (``distributed.health``): it raises
``ReplicaUnhealthyError`` when the instance is stopped, its scheduler died, it is stuck in a
ranking call, or its ranking calls keep raising (its circuit breaker opened), so Serve replaces
the replica and stops routing to it. The snapshots the replica reports say the same (unhealthy,
with the reason), so the ingress's /readyz says why and its legs avoid the replica until then.

The model is rebuilt here from the same ``ModelSource`` as the ingress's, and its digest must
match, so every process serves the same weights. Replies carry the instance's snapshot (for the
ingress's /metrics) and the replica's own id.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.instance_end import SheddingEnd
from relaygr.cascade.instances import build_instance
from relaygr.distributed.health import HealthCheckPolicy, ReplicaHealth, ReplicaUnhealthyError
from relaygr.distributed.ledger import LegLedger
from relaygr.engine.hostmem import tune_host_allocator
from relaygr.engine.snapshot import InstanceSnapshot
from relaygr.engine.transport.messages import (
    AbandonCall,
    ControlCall,
    PreinferCall,
    PreinferReply,
    RankCall,
    RankReply,
    ReplicaState,
)
from relaygr.errors import ConfigError
from relaygr.model.digest import model_digest
from relaygr.relay.costmodel import LatencyCostModel
from relaygr.relay.measure import fit_on_model
from relaygr.server.build import load_model
from relaygr.server.config import ModelSource

log = logging.getLogger("relaygr.replica")


@dataclass(frozen=True)
class ReplicaSpec:
    """How to build one ranking replica."""

    model: ModelSource
    model_digest: str
    system: SystemConfig
    device: str = "cpu"
    # A saved cost model (``LatencyCostModel.to_dict()``); None: time the model on this device.
    cost_model: dict[str, Any] | None = None
    ledger_dir: Path | None = None
    # Intra-op threads for this replica's compute (None: PyTorch's default).
    torch_threads: int | None = None
    # The instance name; None: this Serve replica's id (what the request router hashes).
    name: str | None = None
    # When its instance counts as stuck (``health.liveness``; Serve's check period and timeout
    # are deployment options, ``distributed.app``).
    health: HealthCheckPolicy = field(default_factory=HealthCheckPolicy)


def _serve_replica_id() -> str:
    from ray import serve
    return str(serve.get_replica_context().replica_id.unique_id)


class RankingReplica:
    """See the module docstring. One event loop (the replica's) drives it."""

    def __init__(self, spec: ReplicaSpec) -> None:
        tune_host_allocator()  # this actor's process serves tensors: see engine.hostmem
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        model = load_model(spec.model, spec.device)
        if model_digest(model) != spec.model_digest:
            raise ConfigError("this replica built a different model than the ingress")
        cost_model = LatencyCostModel.from_dict(spec.cost_model) if spec.cost_model \
            else fit_on_model(model, spec.device)
        self.name = spec.name or _serve_replica_id()
        self.system = spec.system
        self.instance = build_instance(spec.system, self.name, spec.device, model, cost_model)
        # the legs' side of the instance; it sheds here (the ingress cannot see this queue)
        self.end = SheddingEnd(self.instance, spec.system)
        self.ledger = None if spec.ledger_dir is None else LegLedger(spec.ledger_dir, self.name)
        self.legs: Counter[str] = Counter()
        self.health = ReplicaHealth(spec.health.liveness, spec.system.breaker)
        self._started = False

    async def _start(self) -> None:
        if not self._started:
            self._started = True
            await self.instance.start()

    async def preinfer(self, call: PreinferCall) -> PreinferReply:
        await self._start()
        reply = self.end.preinfer(call)
        self._record(call, "preinfer", "shed" if reply.shed else reply.result.action.value)
        return reply

    async def abandon(self, call: AbandonCall) -> bool:
        """The pre-infer of ``call.pid`` will see no ranking leg here (``InstanceEnd.abandon``)."""
        await self._start()
        return self.end.abandon(call)

    async def rank(self, call: RankCall) -> RankReply:
        await self._start()
        reply = await self.health.ranked(self.end.rank(call, with_snapshot=True))
        self._record(call, "rank", "shed" if reply.path is None else reply.path.value)
        assert reply.snapshot is not None
        return replace(reply, snapshot=self._reported(reply.snapshot))

    async def check_health(self) -> None:
        """Ray Serve's health check: raises ``ReplicaUnhealthyError`` saying why when the
        started instance is not serving (``ReplicaHealth.fault``); an instance not started
        yet (it starts with the first call) is healthy."""
        why = self._fault()
        if why is not None:
            log.warning("replica %s is unhealthy: %s", self.name, why)
            raise ReplicaUnhealthyError(f"replica {self.name}: {why}")

    def _fault(self) -> str | None:
        return self.health.fault(self.instance) if self._started else None

    def _reported(self, snapshot: InstanceSnapshot) -> InstanceSnapshot:
        """``snapshot`` as the replica reports it: unhealthy, with the reason, while its health
        check fails."""
        why = self._fault()
        return snapshot if why is None else replace(snapshot, healthy=False,
                                                    unhealthy_reason=why)

    async def state(self, call: ControlCall) -> ReplicaState:
        await self._start()
        return ReplicaState(self.name, self._reported(self.instance.snapshot()),
                            dict(self.legs))

    async def quiesce(self, call: ControlCall) -> ReplicaState:
        """Wait for this instance's background work (pre-infer, demotion, fills) to end."""
        await self._start()
        await self.instance.idle()
        return await self.state(call)

    async def integrity(self, call: ControlCall) -> ReplicaState:
        state = await self.quiesce(call)
        await self.instance.check_integrity()
        return state

    def _record(self, call: PreinferCall | RankCall, leg: str, outcome: str) -> None:
        self.legs[leg] += 1
        if self.ledger is not None:
            self.ledger.record(call, leg, outcome)
