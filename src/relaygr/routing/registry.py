"""Routers by name: ``make_router("affinity", spill_queue_depth=4)``."""

from __future__ import annotations

from typing import Any

from relaygr.errors import ConfigError
from relaygr.routing.affinity import AffinityConfig, AffinityRouter
from relaygr.routing.base import Router, config_from_kwargs
from relaygr.routing.baselines import (
    LeastLoadedConfig,
    LeastLoadedRouter,
    RandomConfig,
    RandomRouter,
    RoundRobinConfig,
    RoundRobinRouter,
)

ROUTERS: dict[str, tuple[type[Router], type[Any]]] = {
    AffinityRouter.name: (AffinityRouter, AffinityConfig),
    RoundRobinRouter.name: (RoundRobinRouter, RoundRobinConfig),
    RandomRouter.name: (RandomRouter, RandomConfig),
    LeastLoadedRouter.name: (LeastLoadedRouter, LeastLoadedConfig),
}


def make_router(name: str, **cfg: Any) -> Router:
    """A fresh router of the named kind; ``cfg`` are its config fields (unknown ones are errors)."""
    if name not in ROUTERS:
        raise ConfigError(f"unknown router {name!r}; choose one of {sorted(ROUTERS)}")
    router_type, config_type = ROUTERS[name]
    return router_type(config_from_kwargs(config_type, name, cfg))  # type: ignore[call-arg]
