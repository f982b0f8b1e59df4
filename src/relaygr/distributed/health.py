"""A ranking replica's health, as Ray Serve checks it: is its ranking instance serving?

Ray Serve calls a replica's ``check_health`` every ``health_check_period_s``; a call that raises,
or does not answer within ``health_check_timeout_s``, three times in a row (Serve's
``REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD``) gets the replica replaced, and Serve stops routing to
it. Without a ``check_health`` of its own, a replica whose actor lives counts as healthy however
stuck its instance is: its calls wait for ever and its users keep being routed to it.

``ReplicaHealth`` judges the replica's one in-process ``RankingInstance`` by the rules the
embedded supervisor applies to an instance process (``engine.transport.liveness``):

* the instance is stopped (``healthy`` false after it started): every call would fail;
* its scheduler's loop ended (an error escaped it): queued work would wait for ever;
* a ranking call has been unanswered for ``rank_deadline_s`` and no other ranking call was
  answered in that time (``RankProgress``: stuck in a pass, say a device that hangs, while the
  replica's loop still runs). A replica answering its queue one batch after another is busy,
  not stuck, however long its queue. A call the replica shed (its queue too deep) is answered
  without the instance, so it is no progress: a stuck instance's queue fills, and the calls
  shed then must not hide it.

A call answered with an error is answered (progress): the rules above judge hangs only. Errors
are a circuit breaker's (``cascade.breaker``), with the embedded fleet's settings
(``SystemConfig.breaker``), so one config means the same on both paths: it opens when the
instance's ranking calls raised for its own reasons ``errors_to_open`` times in a row
(``cascade.fleet.failover_for``; the ingress failed each over to the user's next choice). An
answer starts the count again; the request's own errors (its input refused, say) and the calls
the replica shed count neither way. Once open, the breaker stays open, and the check fails,
until Serve replaces the replica: no cool-down, no probe. The new replica is the probe, on a new
process, which is also what clears a device left in an error state; it starts with empty
caches, where an embedded instance's breaker keeps them.

The instance's work for a ranking call runs to its end even when the caller gives up (Serve
cancels a call whose client went away), as a worker process's does, and counts until then, so a
stuck instance is seen whether or not anyone still waits on it. A replica whose own loop is
blocked cannot run the check at all, which Serve counts as a failure at its timeout. The
"silent" rule of a host process has no counterpart here, and neither has its second look: a
verdict needs three failed checks in a row, and the replica's loop turns between them, so an
answer that was only waiting for the loop is seen before the replica is replaced.

Time is ``clock`` (monotonic seconds; tests replace it).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from relaygr.cascade.breaker import BreakerConfig, CircuitBreaker
from relaygr.cascade.fleet import InstanceFailed, failover_for
from relaygr.engine.instance import RankingInstance
from relaygr.engine.transport.liveness import LivenessPolicy, RankProgress
from relaygr.engine.transport.messages import RankReply
from relaygr.errors import ConfigError, RelayGRError


class ReplicaUnhealthyError(RelayGRError):
    """A ranking replica's instance is not serving (Ray Serve replaces the replica)."""


@dataclass(frozen=True)
class HealthCheckPolicy:
    """How Ray Serve checks a ranking replica, and what counts as stuck."""

    # A stuck replica is replaced about rank_deadline_s + 3 periods after its last answer
    # (three failed checks in a row): 5 + 3 x 1 = 8 s. A check is a trivial call (no I/O),
    # so even every second it costs the controller little for one replica per accelerator;
    # Serve's default (10 s) would leave a stuck replica's requests waiting 35 s.
    period_s: float = 1.0
    # A check that does not answer in this time counts as failed: the replica's loop, which
    # runs the check, then did not turn for as long as the deadline of a stuck ranking call.
    timeout_s: float = 5.0
    liveness: LivenessPolicy = field(default_factory=LivenessPolicy)

    def __post_init__(self) -> None:
        for name in ("period_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"HealthCheckPolicy.{name} must be > 0")


class ReplicaHealth:
    """See the module docstring. Driven by the replica's event loop."""

    def __init__(self, policy: LivenessPolicy, breaker: BreakerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        # Never sent a probe (see the module docstring): once open, it stays open.
        self.breaker = CircuitBreaker(breaker)
        # No answer yet: each call waits from when it was sent.
        self._progress = RankProgress(float("-inf"))
        self._keys = itertools.count(1)
        self._running: set[asyncio.Task[RankReply]] = set()    # kept alive until they end

    async def ranked(self, work: Coroutine[Any, Any, RankReply]) -> RankReply:
        """``work`` (one ranking call's answer), counted from now until it ends, and its
        outcome by the breaker; it runs to its end even if this await is cancelled (see the
        module docstring)."""
        progress, key = self._progress, next(self._keys)
        progress.sent(key, self.clock())
        task = asyncio.ensure_future(work)
        self._running.add(task)

        def ended(done: asyncio.Task[RankReply]) -> None:
            self._running.discard(done)
            if done.cancelled() or (done.exception() is None
                                    and done.result().overloaded_retry_s is not None):
                progress.withdraw(key)      # shed (or the loop shut down): not the instance's
                return
            progress.answered(key, self.clock())     # an error is an answer too
            error = done.exception()
            if error is None:
                self.breaker.answered(probe=False)
            elif isinstance(failover_for(None, error), InstanceFailed):
                self.breaker.raised(probe=False, now=self.clock(), error=error)
        task.add_done_callback(ended)
        return await asyncio.shield(task)

    def fault(self, instance: RankingInstance) -> str | None:
        """Why ``instance`` (started) is not serving, or None (see the module docstring)."""
        if not instance.healthy:
            return "its ranking instance is stopped"
        ended = instance.scheduler.loop_ended()
        if ended is not None:
            return f"its scheduler's loop ended ({ended})"
        if self.breaker.reason is not None:
            return self.breaker.reason
        stuck = self._progress.stuck(self.clock(), self.policy.rank_deadline_s)
        if stuck is not None:
            return (f"ranking call unanswered, and no ranking call answered, for "
                    f"{self.clock() - stuck[1]:.2f} s")
        return None
