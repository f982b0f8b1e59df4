"""The router strategy interface and the rendezvous order every affinity decision derives from.

A router maps (user id, membership) to one instance for each leg of a request. Routers keep no
per-user state: the affinity router is a pure function of user id and membership (plus the load
signal for spills), so any process that sees the same membership picks the same instance.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, ClassVar

from relaygr.errors import ConfigError
from relaygr.routing.hashing import name_hash64, pair_weight
from relaygr.routing.types import (
    InstanceView,
    RouteDecision,
    check_user_id,
    healthy_instances,
)
from relaygr.splitmix import mix64


def rendezvous_order(user_id: int, instance_ids: Sequence[str]) -> list[str]:
    """``instance_ids`` sorted by the user's rendezvous (highest-random-weight) preference.

    The weight of a pair depends on nothing but the user id and the instance id, so removing an
    instance never reorders the others for any user (the minimal-disruption property).
    """
    user_hash = mix64(check_user_id(user_id))
    return sorted(instance_ids, key=lambda name: (pair_weight(user_hash, name_hash64(name)), name),
                  reverse=True)


class Router(ABC):
    """Picks the instance for each leg of a user's request.

    ``route`` decides the first leg (the pre-infer signal, or the ranking request when nothing
    was pre-inferred). ``follow`` decides the second leg (the ranking request) given the first
    leg's decision. The default ``follow`` routes the second leg on its own, which is what a
    router without affinity does; the affinity router overrides it to keep both legs together.
    Both raise ``NoHealthyInstanceError`` when no instance is healthy and ``InvalidInputError``
    for a bad user id or a membership that names an instance twice.
    """

    name: ClassVar[str]

    @abstractmethod
    def route(self, user_id: int, instances: Sequence[InstanceView]) -> RouteDecision:
        """The instance for the first leg of ``user_id``'s request."""

    def follow(self, decision: RouteDecision, instances: Sequence[InstanceView]) -> RouteDecision:
        """The instance for the second leg of the request whose first leg was ``decision``."""
        return self.route(decision.user_id, instances)


def config_from_kwargs(config_type: type[Any], router: str, cfg: dict[str, Any]) -> Any:
    """Build a frozen config dataclass from keyword settings; unknown keys are ``ConfigError``."""
    known = {f.name for f in fields(config_type)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"unknown settings for router {router!r}: {unknown}; "
                          f"known: {sorted(known)}")
    return config_type(**cfg)


def healthy_by_preference(user_id: int, instances: Sequence[InstanceView]) -> list[InstanceView]:
    """The healthy instances in the user's rendezvous order."""
    healthy = {view.instance_id: view for view in healthy_instances(instances)}
    return [healthy[name] for name in rendezvous_order(user_id, list(healthy))]
