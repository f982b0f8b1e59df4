"""Building a ranking instance for a system's config, wherever it will run.

``build_instance`` makes the ``RankingInstance`` a mode wants (trigger, tiers, budgets,
batching). The embedded system builds its K instances with it in this process, a worker
process builds each of its instances with it (``engine.transport.host``), and a Ray Serve
replica builds its one instance with it, so every transport runs the same instance logic.
``InstanceFactory`` is what ``RelaySystem`` takes to place its instances elsewhere
(``InstanceProcesses.factory``).
"""

from __future__ import annotations

from collections.abc import Callable

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.modes import Mode, spec_for
from relaygr.engine.handle import InstanceHandle
from relaygr.engine.instance import InstanceConfig, RankingInstance
from relaygr.engine.scheduler import BatchPolicy
from relaygr.model import HSTU
from relaygr.relay.costmodel import LatencyCostModel
from relaygr.relay.trigger import TriggerConfig, make_trigger

# Builds instance ``name`` on ``device`` for a system config (``build_instance`` in this process,
# ``InstanceProcesses.factory`` in processes of their own).
InstanceFactory = Callable[[SystemConfig, str, str, HSTU, LatencyCostModel], InstanceHandle]


def build_instance(config: SystemConfig, name: str, device: str, model: HSTU,
                   cost_model: LatencyCostModel) -> RankingInstance:
    """One ranking instance as ``config``'s mode wants it (see the module docstring)."""
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
