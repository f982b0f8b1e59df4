"""The ranking fleet as the request path reaches it: one small interface, one class per transport.

A ``Fleet`` takes a request's two legs (``cascade.request_path`` sends them) and answers them
from its instances, wherever they run:

* ``InstanceFleet`` (here): K ``InstanceHandle``s behind the mode's router; a handle is a
  ``RankingInstance`` in this process or a ``ProcessInstance`` in a worker process of its own
  (``engine.transport.processes``). The router runs here, over the handles' health and queue depths,
  and the shed rules are checked here, on the queue depths this process sees.
* ``ReplicaFleet`` (``distributed.ingress``): Ray Serve replicas; Serve's request router routes
  each leg with the same ``Router`` (``distributed.router``), and each replica checks the same
  shed rules on its own queue (the ingress cannot see it).

Contract of ``rank``: it follows ``first`` (the first leg's decision) unless that instance is in
``avoid``; it raises ``OverloadedError`` when (and only when) the shed rule refuses the leg,
and ``InstanceLost`` when the instance it went to is gone (the path then fails over: it adds
that instance to ``avoid`` and sends the leg again). ``preinfer`` decides the route
(in-process, at once) or asks for it (across Ray, answered later); either way the path awaits
the ``FirstLeg`` only when it needs it.

The shed rules are written here once (``sheds_preinfer``, ``rank_shed``): pre-infer is shed
first (at ``shed_preinfer_queue_depth`` ranking requests queued), then ranking answers 503 (at
``max_rank_queue_depth``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol

from relaygr.cascade.config import SystemConfig
from relaygr.engine.handle import InstanceHandle
from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.types import (
    FAILED,
    SKIPPED,
    PrefixSpec,
    PreinferResult,
    RankJob,
    RankResult,
)
from relaygr.errors import OverloadedError
from relaygr.routing import InstanceView, RouteDecision, Router

log = logging.getLogger("relaygr.cascade.fleet")


class InstanceLost(Exception):
    """The instance a ranking leg went to is gone (``instance``: its name, when known)."""

    def __init__(self, instance: str | None) -> None:
        super().__init__(f"ranking instance {instance or '?'} is gone")
        self.instance = instance


def sheds_preinfer(rank_queue_depth: int, config: SystemConfig) -> bool:
    """Whether an instance with ``rank_queue_depth`` ranking requests queued skips a pre-infer
    signal (the first thing shed under load)."""
    return rank_queue_depth >= config.overload.shed_preinfer_queue_depth


def rank_shed(name: str, rank_queue_depth: int, config: SystemConfig
              ) -> OverloadedError | None:
    """The refusal of a ranking leg on instance ``name`` at ``rank_queue_depth`` (HTTP 503 with
    Retry-After), or None."""
    if rank_queue_depth < config.overload.max_rank_queue_depth:
        return None
    return OverloadedError(f"{name} has {rank_queue_depth} ranking requests queued",
                   retry_after_s=max(0.1, config.slo_ms / 1e3))


@dataclass
class FirstLeg:
    """Where a request's first leg went and what it did.

    ``route``: the decision the second leg follows (None: the second leg is routed when sent).
    ``instance``: the instance that got the pre-infer signal (None: no signal was sent).
    ``result``: its outcome (an awaitable when it comes from another process). ``shed``: skipped
    by ``sheds_preinfer``; ``lost``: the instance was gone (the signal did nothing).
    """

    route: RouteDecision | None
    instance: str | None = None
    result: PreinferResult | Awaitable[PreinferResult] | None = None
    shed: bool = False
    lost: bool = False


class Fleet(Protocol):
    """The instances behind the request path (see the module docstring)."""

    @property
    def max_attempts(self) -> int:
        """How many instances a ranking leg tries before ``NoHealthyInstanceError``."""

    def preinfer(self, request_id: str, user_id: int, spec: PrefixSpec, suffix_tokens: int,
                 candidates: int, send: bool) -> FirstLeg | Awaitable[FirstLeg]:
        """Route the first leg and, when ``send``, signal it (shed by ``sheds_preinfer``)."""

    async def rank(self, request_id: str, user_id: int, first: RouteDecision | None,
                   job: RankJob, avoid: tuple[str, ...]) -> RankResult:
        """Rank ``job`` where ``first`` went (see the module docstring for the errors)."""


class InstanceFleet:
    """``Fleet`` over K instance handles in this process's reach (see the module docstring)."""

    def __init__(self, instances: Sequence[InstanceHandle], router: Router,
                 config: SystemConfig) -> None:
        self.instances = list(instances)
        self.by_name = {inst.name: inst for inst in self.instances}
        self.router = router
        self.config = config

    @property
    def max_attempts(self) -> int:
        return len(self.instances)

    def views(self, avoid: tuple[str, ...] = ()) -> list[InstanceView]:
        """What the router sees: each instance's health (false if avoided) and queue depth."""
        return [InstanceView(i.name, i.healthy and i.name not in avoid, i.queue_depth)
                for i in self.instances]

    def preinfer(self, request_id: str, user_id: int, spec: PrefixSpec, suffix_tokens: int,
                 candidates: int, send: bool) -> FirstLeg:
        decision = self.router.route(user_id, self.views())
        if not send:
            return FirstLeg(decision)
        instance = self.by_name[decision.instance_id]
        if sheds_preinfer(instance.rank_queue_depth, self.config):
            return FirstLeg(decision, instance.name, SKIPPED, shed=True)
        try:
            result = instance.preinfer(spec, suffix_tokens, candidates)
        except AssertionError:
            raise
        except Exception:   # advisory: the signal is lost, ranking computes the prefix
            log.warning("the pre-infer of user %d on %s raised", user_id, instance.name,
                        exc_info=True)
            return FirstLeg(decision, instance.name, FAILED, lost=True)
        return FirstLeg(decision, instance.name, result)

    async def rank(self, request_id: str, user_id: int, first: RouteDecision | None,
                   job: RankJob, avoid: tuple[str, ...]) -> RankResult:
        views = self.views(avoid)
        decision = self.router.route(user_id, views) if first is None else \
            self.router.follow(first, views)
        instance = self.by_name[decision.instance_id]
        shed = rank_shed(instance.name, instance.rank_queue_depth, self.config)
        if shed is not None:
            raise shed
        try:
            return await instance.rank(job)
        except InstanceStoppedError as exc:
            raise InstanceLost(instance.name) from exc
