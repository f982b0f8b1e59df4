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
from dataclasses import replace

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.modes import Mode, spec_for
from relaygr.engine.handle import InstanceHandle
from relaygr.engine.instance import RankingInstance
from relaygr.model import HSTU
from relaygr.relay.costmodel import LatencyCostModel
from relaygr.relay.trigger import make_trigger

# Builds instance ``name`` on ``device`` for a system config (``build_instance`` in this process,
# ``InstanceProcesses.factory`` in processes of their own).
InstanceFactory = Callable[[SystemConfig, str, str, HSTU, LatencyCostModel], InstanceHandle]


def build_instance(config: SystemConfig, name: str, device: str, model: HSTU,
                   cost_model: LatencyCostModel) -> RankingInstance:
    """One ranking instance as ``config``'s mode wants it (see the module docstring)."""
    spec = spec_for(Mode.parse(config.mode))
    trigger = None
    if spec.trigger is not None:
        trigger = make_trigger(spec.trigger, cost_model, config.trigger, config.slo_ms)
    wanted = config.instance    # the mode keeps the tiers it uses
    instance = replace(wanted,
                       device_budget_bytes=wanted.device_budget_bytes if spec.device_cache else 0,
                       host_budget_bytes=wanted.host_budget_bytes if spec.host_tier else 0)
    return RankingInstance(name, device, instance, model.eval(), trigger)
