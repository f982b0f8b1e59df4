"""Value types at the router's boundary: what a router sees of an instance, and what it decides."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from relaygr.errors import InvalidInputError, NoHealthyInstanceError


@dataclass(frozen=True)
class InstanceView:
    """A router's snapshot of one ranking instance.

    ``instance_id`` is the instance's stable name (the hash key, so it must not change while the
    instance lives); ``queue_depth`` is its load signal: ranking requests queued or running on
    it. Queued pre-infer work is not load: a ranking request waits behind at most one of its
    chunks (``engine.scheduler``), and a spill it caused would move the user off the instance
    that holds its cache, to be pre-inferred again elsewhere. Under Ray Serve it is the replica's
    ongoing calls, in which a pre-infer call counts only until it is answered (at once).
    """

    instance_id: str
    healthy: bool = True
    queue_depth: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.instance_id, str) or not self.instance_id:
            raise InvalidInputError(
                f"instance_id must be a non-empty str, got {self.instance_id!r}")
        if not isinstance(self.queue_depth, int) or isinstance(self.queue_depth, bool) \
                or self.queue_depth < 0:
            raise InvalidInputError(f"queue_depth must be an int >= 0, got {self.queue_depth!r}")


class RouteReason(enum.Enum):
    """Why a leg went where it went."""

    OWNER = "owner"                    # affinity: the user's first healthy choice
    SPILLED = "spilled"                # affinity: owner over the spill threshold, a later choice
    ALL_OVERLOADED = "all_overloaded"  # affinity: every choice considered was over the threshold
    FOLLOWED = "followed"              # second leg: the first leg's instance, still healthy
    FAILOVER = "failover"              # second leg: the first leg's instance failed, next choice
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"


@dataclass(frozen=True)
class RouteDecision:
    """Where one leg of a user's request goes.

    ``rank`` is the position of ``instance_id`` in the user's rendezvous order over the healthy
    instances at decision time (0 = owner); baseline routers that ignore the user report the
    position in the healthy list they chose from. ``spilled`` is true when a load spill moved the
    leg off the owner (and stays true on a second leg that followed it).
    """

    user_id: int
    instance_id: str
    rank: int
    spilled: bool
    reason: RouteReason


def check_user_id(user_id: int) -> int:
    if not isinstance(user_id, int) or isinstance(user_id, bool) or not 0 <= user_id < 1 << 64:
        raise InvalidInputError(f"user_id must be an int in [0, 2**64), got {user_id!r}")
    return user_id


def healthy_instances(instances: Sequence[InstanceView]) -> list[InstanceView]:
    """The healthy members, in the given order; typed errors for duplicates or none healthy."""
    seen: set[str] = set()
    for view in instances:
        if not isinstance(view, InstanceView):
            raise InvalidInputError(f"instances must be InstanceView, got {type(view).__name__}")
        if view.instance_id in seen:
            raise InvalidInputError(f"instance id {view.instance_id!r} appears twice")
        seen.add(view.instance_id)
    healthy = [view for view in instances if view.healthy]
    if not healthy:
        raise NoHealthyInstanceError(f"none of the {len(instances)} instances is healthy")
    return healthy
