"""Circuit breakers: an instance whose ranking calls keep raising is taken out of routing.

A ranking call that raises for the instance's own reasons (``cascade.fleet.instance_fault``: not
the request's input, not a shed leg) fails over to the user's next choice, which answers
correctly. Without more, the router would send that instance's users back to it on every
request, each paying an error and a second pass. ``InstanceFleet`` keeps one ``CircuitBreaker``
per instance:

* closed: routed as usual. ``BreakerConfig.errors_to_open`` instance errors in a row open it; an
  answer in between starts the count again.
* open: not routed (its users go to their next choice, which computes their prefixes) until
  ``cool_down_s`` after it opened.
* half-open (the cool-down is over): routed for one request, the probe, and not routed while
  the probe is out. A request's first leg (its pre-infer signal) routed there reserves the probe
  for its request (``reserve``), so its ranking leg, which follows the first leg, is the probe;
  meanwhile other requests' legs go to their next choice, and their ranking legs follow them
  there (none is moved off the prefix it pre-inferred). Without a reservation, the first ranking
  leg routed there is the probe. A reservation whose ranking leg does not come within
  ``hold_s`` (a pre-infer signal alone, a request that failed before ranking) lapses. The
  probe's answer closes the breaker; its error opens it for another cool-down; a probe that
  proves nothing either way (the request's own error, the instance gone, the leg cancelled or
  shed, or sent elsewhere) leaves the probe to the next request.

A Ray replica keeps one over its own instance (``distributed.health``) and no leg is ever its
probe: once open it stays open, the replica's health check fails, and Ray Serve replaces the
replica.

While the breaker is not closed, only the probe's outcome counts: legs sent before it opened
say nothing of the instance now. The breaker judges errors, never silence: an instance that does
not answer at all is the hang rules' (``engine.transport.liveness``, ``distributed.health``),
which count an error reply as an answer. Time is the caller's clock (the event loop's
``loop.time()``) passed in as ``now``, so tests run the breaker on controlled time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from relaygr.errors import ConfigError
from relaygr.settings import require_positive_ints


@dataclass(frozen=True)
class BreakerConfig:
    """When a ranking instance's breaker opens, and for how long."""

    # One error can be a transient (a pass that hit a device allocation failure once); three in
    # a row with no answer between them is an instance that is broken, and costs its users only
    # three failovers (each a correct answer, later) before they stop being sent there.
    errors_to_open: int = 3
    # A probe that fails costs one request a failover, so probing every 10 s is cheap; and an
    # instance whose fault cleared (a device reset) gets its users, and their cache, back
    # within seconds, not minutes.
    cool_down_s: float = 10.0

    def __post_init__(self) -> None:
        require_positive_ints(self, "errors_to_open")
        if not self.cool_down_s > 0:
            raise ConfigError(f"BreakerConfig.cool_down_s must be > 0, got {self.cool_down_s!r}")


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """One instance's breaker (see the module docstring). One event loop drives it.

    ``holder``: the request (its id) that a first leg reserved the probe for; the breaker is
    routable to that request's ranking leg while the reservation stands."""

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self.errors = 0             # instance errors in a row, while closed
        self.opened = 0             # times it opened (a failed probe opens it again)
        self._open = False
        self._probe_at = 0.0        # while open: when the cool-down ends
        self._probing = False       # while half-open: the probe is out (a ranking leg sent)
        self._holder: str | None = None     # while half-open: the request that reserved it
        self._hold_until = 0.0      # ... until then
        self._why = ""

    def state(self, now: float) -> BreakerState:
        if not self._open:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now < self._probe_at else BreakerState.HALF_OPEN

    @property
    def reason(self) -> str | None:
        """Why the instance is out of routing (None while closed): its health report's reason,
        until a probe has answered."""
        return self._why if self._open else None

    def routable(self, now: float, holder: str | None = None) -> bool:
        """Whether a leg of request ``holder`` (None: a request that holds nothing, such as a
        first leg) may be routed to the instance now: closed, or half-open with no probe out
        or reserved for another request."""
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN or self._probing:
            return False
        return self._reserved_by(now) in (None, holder)

    def reserve(self, now: float, holder: str, hold_s: float) -> bool:
        """A first leg of request ``holder`` goes to the instance now; whether it reserved the
        probe (half-open, no probe out nor reserved) for that request's ranking leg, for at
        most ``hold_s``."""
        if self.state(now) is not BreakerState.HALF_OPEN or self._probing \
                or self._reserved_by(now) is not None:
            return False
        self._holder, self._hold_until = holder, now + hold_s
        return True

    def release(self, holder: str) -> None:
        """Request ``holder``'s ranking leg will not be the probe (it went elsewhere, or was
        shed): its reservation, if it holds one, passes to the next request."""
        if self._holder == holder:
            self._holder = None

    def send(self, now: float, holder: str | None = None) -> bool:
        """A ranking leg (of request ``holder``) goes to the instance now; whether it is the
        probe: the leg whose request reserved it, or the first leg sent while it is half-open
        with no probe out nor reserved. Its outcome is then reported once: ``answered``,
        ``raised`` or ``proved_nothing``."""
        if self.state(now) is not BreakerState.HALF_OPEN or self._probing:
            return False
        reserved = self._reserved_by(now)
        if reserved is not None and reserved != holder:
            return False
        self._probing, self._holder = True, None
        return True

    def _reserved_by(self, now: float) -> str | None:
        """The request the probe is reserved for now (None: not reserved, or it lapsed)."""
        return self._holder if self._holder is not None and now < self._hold_until else None

    def answered(self, probe: bool) -> bool:
        """The leg was answered; whether that closed the breaker (the probe answered)."""
        if probe:
            self._probing = self._open = False
            self._holder = None
            self.errors = 0
            return True
        if not self._open:
            self.errors = 0
        return False

    def raised(self, probe: bool, now: float, error: BaseException) -> bool:
        """The leg raised for the instance's own reasons; whether that opened the breaker."""
        what = f"{type(error).__name__}: {error}"
        if probe:
            self._probing = False
            self._trip(now, f"its probe raised {what}")
            return True
        if self._open:
            return False
        self.errors += 1
        if self.errors < self.config.errors_to_open:
            return False
        self._trip(now, f"{self.errors} ranking calls in a row raised (the last: {what})")
        return True

    def proved_nothing(self, probe: bool) -> None:
        """The leg ended neither answered nor failed by the instance (the request's own error,
        the instance gone, the leg cancelled): a probe's turn passes to the next leg."""
        if probe:
            self._probing = False

    def _trip(self, now: float, why: str) -> None:
        self._open = True
        self._holder = None
        self._probe_at = now + self.config.cool_down_s
        self.errors = 0
        self.opened += 1
        self._why = f"circuit breaker open: {why}"
