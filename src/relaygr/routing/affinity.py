"""Affinity routing: rendezvous hashing of user ids with a bounded-load spill.

Invariants:
- Both legs of a request land on one instance while it stays healthy (``follow``).
- With no spill, a user's instance depends only on the user id and the set of healthy
  instances; when one instance leaves, only its users move (each to its next choice), and when
  one joins, only the users that now rank it first move to it.
- A spill moves a leg at most ``max_spill_hops`` places down the user's order, so a user's
  cache entries live on at most ``1 + max_spill_hops`` instances.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from relaygr.errors import ConfigError
from relaygr.routing.base import Router, healthy_by_preference
from relaygr.routing.types import InstanceView, RouteDecision, RouteReason, check_user_id


@dataclass(frozen=True)
class AffinityConfig:
    """Spill settings. ``max_spill_hops = 0`` disables spilling (pure user-id routing)."""

    # A ranking queue deeper than this means the owner is several ranking batches behind:
    # waiting there costs more tail latency than computing the prefix on a less loaded
    # instance. Queued pre-infer work is not load (``InstanceView.queue_depth``).
    spill_queue_depth: int = 8
    # One hop: a spilled user's cache is on at most two instances, and a hot owner sheds load
    # to a different instance for each of its users (their second choices differ).
    max_spill_hops: int = 1

    def __post_init__(self) -> None:
        for name in ("spill_queue_depth", "max_spill_hops"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"AffinityConfig.{name} must be an int >= 0, got {value!r}")


class AffinityRouter(Router):
    """Rendezvous hashing with a bounded-load spill on the first leg.

    First leg: the user's healthy instances in rendezvous order; the first whose
    ``queue_depth`` is at most ``spill_queue_depth`` among the first ``1 + max_spill_hops``
    wins (reason OWNER at rank 0, SPILLED after). When all of those are over the threshold, the
    least loaded of them wins (ties to the earlier choice; reason ALL_OVERLOADED): the spill never
    scatters a user further than the bound, and never refuses a request.

    Second leg (``follow``): the first leg's instance while it is healthy (reason FOLLOWED; the
    ranking request consumes the cache there, whatever its queue). If it failed or left, the
    user's first healthy choice now (reason FAILOVER; the leg finds no cache there and computes).
    """

    name = "affinity"

    def __init__(self, config: AffinityConfig | None = None) -> None:
        self.config = config or AffinityConfig()

    def route(self, user_id: int, instances: Sequence[InstanceView]) -> RouteDecision:
        order = healthy_by_preference(user_id, instances)
        considered = order[: 1 + self.config.max_spill_hops]
        for rank, view in enumerate(considered):
            if view.queue_depth <= self.config.spill_queue_depth:
                reason = RouteReason.OWNER if rank == 0 else RouteReason.SPILLED
                return RouteDecision(user_id, view.instance_id, rank, rank > 0, reason)
        rank = min(range(len(considered)), key=lambda r: (considered[r].queue_depth, r))
        return RouteDecision(user_id, considered[rank].instance_id, rank, rank > 0,
                             RouteReason.ALL_OVERLOADED)

    def follow(self, decision: RouteDecision, instances: Sequence[InstanceView]) -> RouteDecision:
        user_id = check_user_id(decision.user_id)
        order = healthy_by_preference(user_id, instances)
        for rank, view in enumerate(order):
            if view.instance_id == decision.instance_id:
                return RouteDecision(user_id, view.instance_id, rank, decision.spilled,
                                     RouteReason.FOLLOWED)
        return RouteDecision(user_id, order[0].instance_id, 0, False, RouteReason.FAILOVER)
