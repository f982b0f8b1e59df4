"""The ranking fleet as the request path reaches it: one small interface, one class per transport.

A ``Fleet`` takes a request's two legs (``cascade.request_path`` sends them) and answers them
from its instances, wherever they run:

* ``InstanceFleet`` (here): K ``InstanceHandle``s behind the mode's router; a handle is a
  ``RankingInstance`` in this process or a ``ProcessInstance`` in a worker process of its own
  (``engine.transport.processes``). The router runs here, over the handles' health and ranking
  queue depths,
  and the shed rules are checked here, on the queue depths this process sees.
* ``ReplicaFleet`` (``distributed.ingress``): Ray Serve replicas; Serve's request router routes
  each leg with the same ``Router`` (``distributed.router``), and each replica checks the same
  shed rules on its own queue (the ingress cannot see it).

Contract of ``rank``: it follows ``first`` (the first leg's decision) unless that instance is in
``avoid``, and answers a ``RankedLeg``: the result, and the decision that sent the leg (reason
``FAILOVER`` when the router's ``follow`` moved it off ``first``'s instance, which was down or
out of routing when the leg came: no error is raised then, and the path counts it). It raises
``OverloadedError`` when (and only when) the shed rule refuses the leg, and ``InstanceLost``
when the instance it went to is gone, or ``InstanceFailed`` (an ``InstanceLost``) when it
raised for its own reasons (the path then fails over: it adds that instance to ``avoid`` and
sends the leg again). Which errors are whose is written here once
(``failover_for``): the request's own (``REQUEST_FAULTS``: its input is invalid, its leg was
shed, the history store every instance reads is out of reach) propagate as they are, since
another instance would refuse the request the same way; anything else a ranking call raises is
the instance's (a device error, a corrupted cache, a bug), and another instance answers.
Assertions propagate too: a broken invariant is a bug to see, not to route around.
``abandon`` tells the instance a delivered pre-infer signal went to that its ranking leg will
not come (it was shed, failed over, or its request failed), so the pre-infer's footprint is freed
there at once rather than when its lease ends.

``preinfer`` decides the route (in-process, at once) or asks for it (across Ray, answered
later); either way the path awaits the ``FirstLeg`` only when it needs it.

``InstanceFleet`` keeps a circuit breaker per instance (``cascade.breaker``): an instance whose
ranking calls keep raising is left out of the router's views, and its snapshot reports it
unhealthy with the reason, until a probe answers. A first leg routed to a half-open instance
reserves its probe for the request (for the pre-infer's lease, ``InstanceConfig.lease_s``: a
ranking leg that has not come by then finds no relayed prefix anyway), so the ranking leg that
follows it is the probe, and the instance is out of the other requests' views meanwhile. The
breakers never take the whole fleet out: when no instance that is up would be routable, they
are ignored (each request then fails over, or fails, on its own).

The shed rules are written here once (``sheds_preinfer``, ``rank_shed``): pre-infer is shed
first (at ``shed_preinfer_queue_depth`` ranking requests queued), then ranking answers 503 (at
``max_rank_queue_depth``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from relaygr.cascade.breaker import CircuitBreaker
from relaygr.cascade.config import SystemConfig
from relaygr.engine.handle import InstanceHandle
from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.snapshot import InstanceSnapshot
from relaygr.engine.types import (
    FAILED,
    SKIPPED,
    PrefixSpec,
    PreinferResult,
    RankJob,
    RankResult,
)
from relaygr.errors import HistoryStoreUnavailableError, InvalidInputError, OverloadedError
from relaygr.kvcache import PrefixId
from relaygr.routing import InstanceView, RouteDecision, Router

log = logging.getLogger("relaygr.cascade.fleet")


# What a ranking call raises for the request itself: the same request fails the same way on any
# instance, so these are the caller's answer, never failed over nor held against the instance.
REQUEST_FAULTS: tuple[type[Exception], ...] = (
    InvalidInputError, OverloadedError, HistoryStoreUnavailableError)


class InstanceLost(Exception):
    """The instance a ranking leg went to is gone (``instance``: its name, when known)."""

    def __init__(self, instance: str | None, message: str | None = None) -> None:
        super().__init__(message or f"ranking instance {instance or '?'} is gone")
        self.instance = instance


class InstanceFailed(InstanceLost):
    """The instance a ranking leg went to raised ``error`` for its own reasons
    (``instance_fault``): the leg fails over as from an instance that is gone."""

    def __init__(self, instance: str | None, error: BaseException) -> None:
        super().__init__(instance, f"ranking instance {instance or '?'} raised "
                                   f"{type(error).__name__}: {error}")
        self.error = error


def instance_fault(error: BaseException) -> bool:
    """Whether ``error``, raised by a ranking call, is the instance's fault rather than the
    request's (see the module docstring)."""
    return isinstance(error, Exception) and not isinstance(error, (*REQUEST_FAULTS,
                                                                   AssertionError))


def failover_for(instance: str | None, error: BaseException) -> InstanceLost | None:
    """What a ranking call to ``instance`` that raised ``error`` asks of the path:
    ``InstanceLost`` (it is gone), ``InstanceFailed`` (it raised: ``instance_fault``), or None
    (the request's own error: it propagates as it is)."""
    if isinstance(error, InstanceStoppedError):
        return InstanceLost(instance)
    return InstanceFailed(instance, error) if instance_fault(error) else None


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
    by ``sheds_preinfer``; ``lost``: the signal did nothing, its instance gone or its pre-infer
    raised (counted once, in ``lost_preinfer``).
    """

    route: RouteDecision | None
    instance: str | None = None
    result: PreinferResult | Awaitable[PreinferResult] | None = None
    shed: bool = False
    lost: bool = False


@dataclass(frozen=True)
class RankedLeg:
    """A ranking leg's answer (``result``, whose ``instance`` answered it) and the decision that
    sent it there (``route``: its reason is ``FAILOVER`` when ``follow`` moved the leg off its
    first leg's instance)."""

    result: RankResult
    route: RouteDecision


class Fleet(Protocol):
    """The instances behind the request path (see the module docstring)."""

    @property
    def max_attempts(self) -> int:
        """How many instances a ranking leg tries before ``NoHealthyInstanceError``."""

    def preinfer(self, request_id: str, user_id: int, spec: PrefixSpec, suffix_tokens: int,
                 candidates: int, send: bool) -> FirstLeg | Awaitable[FirstLeg]:
        """Route the first leg and, when ``send``, signal it (shed by ``sheds_preinfer``)."""

    async def rank(self, request_id: str, user_id: int, first: RouteDecision | None,
                   job: RankJob, avoid: tuple[str, ...]) -> RankedLeg:
        """Rank ``job`` where ``first`` went (see the module docstring for the errors)."""

    def abandon(self, request_id: str, first: FirstLeg, pid: PrefixId) -> None:
        """``first``'s pre-infer of ``pid`` will see no ranking leg (shed, failed over): its
        instance frees the footprint (``RankingInstance.abandon``). Advisory: raises nothing
        (a lease still ends on its own), and does nothing for a signal not delivered."""


class InstanceFleet:
    """``Fleet`` over K instance handles in this process's reach (see the module docstring).

    ``clock``: the breakers' time (None: the running event loop's ``loop.time()``)."""

    def __init__(self, instances: Sequence[InstanceHandle], router: Router,
                 config: SystemConfig, clock: Callable[[], float] | None = None) -> None:
        self.instances = list(instances)
        self.by_name = {inst.name: inst for inst in self.instances}
        self.router = router
        self.config = config
        self.breakers = {inst.name: CircuitBreaker(config.breaker) for inst in self.instances}
        self.clock = clock

    @property
    def max_attempts(self) -> int:
        return len(self.instances)

    @property
    def breaker_opens(self) -> int:
        """Times a breaker opened, over every instance."""
        return sum(b.opened for b in self.breakers.values())

    def _now(self) -> float:
        return asyncio.get_running_loop().time() if self.clock is None else self.clock()

    def views(self, avoid: tuple[str, ...] = (), holder: str | None = None
              ) -> list[InstanceView]:
        """What the router sees: each instance's ranking queue depth (its load signal: queued
        pre-infer work is not load, ``routing.types.InstanceView``), and its health: up, not in
        ``avoid``, and its breaker routable to request ``holder``'s legs (the breakers are
        ignored where they would leave no instance that is up routable: see the module
        docstring)."""
        now = self._now()
        up = [i.healthy for i in self.instances]
        routable = [u and self.breakers[i.name].routable(now, holder)
                    for i, u in zip(self.instances, up, strict=True)]
        if not any(routable):
            routable = up
        return [InstanceView(i.name, r and i.name not in avoid, i.rank_queue_depth)
                for i, r in zip(self.instances, routable, strict=True)]

    def snapshots(self) -> tuple[InstanceSnapshot, ...]:
        """Each instance's snapshot; one whose breaker is open is unhealthy, with the reason."""
        out = []
        for inst in self.instances:
            snap, why = inst.snapshot(), self.breakers[inst.name].reason
            out.append(snap if why is None else replace(snap, healthy=False,
                                                        unhealthy_reason=why))
        return tuple(out)

    def preinfer(self, request_id: str, user_id: int, spec: PrefixSpec, suffix_tokens: int,
                 candidates: int, send: bool) -> FirstLeg:
        decision = self.router.route(user_id, self.views())
        if not send:
            return FirstLeg(decision)
        instance = self.by_name[decision.instance_id]
        if self.breakers[instance.name].reserve(self._now(), request_id,
                                                self.config.instance.lease_s):
            log.info("%s is half-open: request %s's ranking leg is its probe", instance.name,
                     request_id)
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
                   job: RankJob, avoid: tuple[str, ...]) -> RankedLeg:
        views = self.views(avoid, holder=request_id)
        decision = self.router.route(user_id, views) if first is None else \
            self.router.follow(first, views)
        instance = self.by_name[decision.instance_id]
        for name, other in self.breakers.items():
            if name != instance.name:       # a probe reserved there will not be taken
                other.release(request_id)
        breaker = self.breakers[instance.name]
        shed = rank_shed(instance.name, instance.rank_queue_depth, self.config)
        if shed is not None:
            breaker.release(request_id)
            raise shed
        probe = breaker.send(self._now(), request_id)
        try:
            result = await instance.rank(job)
        except BaseException as exc:
            failover = failover_for(instance.name, exc)
            if not isinstance(failover, InstanceFailed):
                breaker.proved_nothing(probe)
            elif breaker.raised(probe, self._now(), exc):
                log.warning("%s is out of routing for %g s (%s); its users go to their next "
                            "choice", instance.name, breaker.config.cool_down_s, breaker.reason)
            if failover is None:
                raise
            raise failover from exc
        if breaker.answered(probe):
            log.info("%s answered its probe: its circuit breaker is closed", instance.name)
        return RankedLeg(result, decision)

    def abandon(self, request_id: str, first: FirstLeg, pid: PrefixId) -> None:
        instance = None if first.instance is None else self.by_name.get(first.instance)
        if instance is None or first.shed or first.lost or not instance.healthy:
            return
        try:
            sent = instance.abandon(pid)
        except AssertionError:
            raise
        except Exception:       # advisory: the lease still ends on its own
            log.warning("abandoning user %d's pre-infer on %s raised", pid.user_id,
                        instance.name, exc_info=True)
            return
        if not isinstance(sent, bool):       # from another process: answered later
            asyncio.ensure_future(sent).add_done_callback(_ignore_outcome)


def _ignore_outcome(done: asyncio.Future[bool]) -> None:
    if not done.cancelled():
        done.exception()        # retrieved: a stopped instance's reply is no error here
