"""Baseline routers for comparison: round-robin, seeded random, least-loaded.

None of them keeps a user on one instance, so their second leg is routed on its own (the
inherited ``Router.follow``): a pre-inferred prefix is consumed only when both legs happen to
land together. That is the ``relay-no-affinity`` ablation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from relaygr.errors import ConfigError
from relaygr.routing.base import Router, healthy_by_preference
from relaygr.routing.types import (
    InstanceView,
    RouteDecision,
    RouteReason,
    check_user_id,
    healthy_instances,
)


@dataclass(frozen=True)
class RoundRobinConfig:
    """Round-robin has no settings; the cycle starts at the first healthy instance."""


@dataclass(frozen=True)
class RandomConfig:
    """The seed makes a run reproducible: the same calls pick the same instances."""

    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"RandomConfig.seed must be an int, got {self.seed!r}")


@dataclass(frozen=True)
class LeastLoadedConfig:
    """Least-loaded has no settings; ties go to the user's rendezvous order."""


class RoundRobinRouter(Router):
    """Cycles through the healthy instances, one call after another, whatever the user.

    The i-th call (counting every leg) goes to ``healthy[i % len(healthy)]``; ``rank`` is that
    index. Deterministic given the sequence of calls and memberships.
    """

    name = "round-robin"

    def __init__(self, config: RoundRobinConfig | None = None) -> None:
        self.config = config or RoundRobinConfig()
        self._calls = 0

    def route(self, user_id: int, instances: Sequence[InstanceView]) -> RouteDecision:
        check_user_id(user_id)
        healthy = healthy_instances(instances)
        index = self._calls % len(healthy)
        self._calls += 1
        return RouteDecision(user_id, healthy[index].instance_id, index, False,
                             RouteReason.ROUND_ROBIN)


class RandomRouter(Router):
    """Picks a healthy instance uniformly at random from a seeded generator; ``rank`` is its
    index in the healthy list."""

    name = "random"

    def __init__(self, config: RandomConfig | None = None) -> None:
        self.config = config or RandomConfig()
        self._rng = random.Random(self.config.seed)

    def route(self, user_id: int, instances: Sequence[InstanceView]) -> RouteDecision:
        check_user_id(user_id)
        healthy = healthy_instances(instances)
        index = self._rng.randrange(len(healthy))
        return RouteDecision(user_id, healthy[index].instance_id, index, False,
                             RouteReason.RANDOM)


class LeastLoadedRouter(Router):
    """Picks the healthy instance with the smallest ``queue_depth``.

    Ties go to the earliest in the user's rendezvous order (deterministic, and idle instances
    share users evenly instead of all going to the first); ``rank`` is the position in that order.
    """

    name = "least-loaded"

    def __init__(self, config: LeastLoadedConfig | None = None) -> None:
        self.config = config or LeastLoadedConfig()

    def route(self, user_id: int, instances: Sequence[InstanceView]) -> RouteDecision:
        order = healthy_by_preference(user_id, instances)
        rank = min(range(len(order)), key=lambda r: (order[r].queue_depth, r))
        return RouteDecision(user_id, order[rank].instance_id, rank, False,
                             RouteReason.LEAST_LOADED)
