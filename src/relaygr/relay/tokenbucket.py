"""A token bucket bounding the pre-infer compute load, in history tokens per second."""

from __future__ import annotations

import time
from collections.abc import Callable

from relaygr.errors import ConfigError, InvalidInputError

Clock = Callable[[], float]


class TokenBucket:
    """Holds up to ``capacity_tokens``; refills at ``rate_tokens_per_s`` on the injected clock.

    ``try_take(n)`` takes ``n`` tokens when the level is at least ``n``, or when the bucket is
    full (a job larger than the whole bucket may then run, leaving the level negative: it is
    paid back by refill before anything else is admitted). So over any window of ``t`` seconds
    the tokens taken are at most ``capacity + rate * t + (largest job)``. Not thread-safe: one
    event loop owns it.
    """

    def __init__(self, rate_tokens_per_s: float, capacity_tokens: float,
                 clock: Clock = time.monotonic) -> None:
        if not rate_tokens_per_s > 0 or not capacity_tokens > 0:
            raise ConfigError("a token bucket needs rate_tokens_per_s > 0 and capacity_tokens > 0, "
                              f"got {rate_tokens_per_s!r} and {capacity_tokens!r}")
        self.rate_tokens_per_s = float(rate_tokens_per_s)
        self.capacity_tokens = float(capacity_tokens)
        self._clock = clock
        self._level = self.capacity_tokens
        self._stamp_s = clock()

    @property
    def level_tokens(self) -> float:
        """Tokens available now (negative while a large job is being paid back)."""
        self._refill()
        return self._level

    def try_take(self, tokens: float) -> bool:
        """Take ``tokens`` if allowed (see the class contract); False changes nothing."""
        if tokens < 0:
            raise InvalidInputError(f"cannot take a negative number of tokens ({tokens})")
        self._refill()
        if self._level >= tokens or self._level >= self.capacity_tokens:
            self._level -= tokens
            return True
        return False

    def give_back(self, tokens: float) -> None:
        """Return ``tokens`` taken for work that did not run (never above the capacity)."""
        if tokens < 0:
            raise InvalidInputError(f"cannot give back a negative number of tokens ({tokens})")
        self._refill()
        self._level = min(self.capacity_tokens, self._level + tokens)

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._stamp_s)   # a clock that steps back adds nothing
        self._stamp_s = max(self._stamp_s, now)
        self._level = min(self.capacity_tokens, self._level + elapsed * self.rate_tokens_per_s)
