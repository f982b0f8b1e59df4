"""Whether a point met its P99 SLO: a verdict only when the sample says so at a confidence.

The rule (our derivation; the anchor is the early-stopping rule of the MLCommons inference
policies, which states how many queries and how many over-latency queries a tail-latency
verdict needs at a confidence):

Let ``q`` be the quantile (0.99) and ``p`` the true share of requests whose ranking latency
exceeds the SLO ``S``. The q-quantile is <= S exactly when ``p <= 1 - q`` (1%). Over ``n``
independent requests the number of overages ``M`` is Binomial(n, p), and its tails move with
``p`` in one direction: ``P(M <= m | p)`` falls and ``P(M >= m | p)`` rises as ``p`` grows. So,
with ``alpha = 1 - confidence`` and ``m`` overages seen:

- **pass** (P99 <= S) when ``P(M <= m | n, 1 - q) <= alpha``: were P99 above the SLO (any
  ``p >= 1 - q``), a sample with this few overages would turn up at most ``alpha`` of the time;
- **fail** (P99 > S) when ``P(M >= m | n, 1 - q) <= alpha``: were P99 within the SLO (any
  ``p <= 1 - q``), this many overages would turn up at most ``alpha`` of the time;
- **undecided** otherwise: the sample cannot tell, however the point's P99 estimate looks.

With no overage a pass needs ``(1 - 1%)^n <= alpha``: n >= ln(alpha) / ln(0.99), i.e. 459
requests at 99% confidence (299 at 95%, 230 at 90%); each further overage needs more (662 for
one at 99%). A point of 40 requests with one 50 ms spike is undecided, not failed: one overage
in 40 turns up with probability 1 - 0.99^40 = 0.33 even when P99 is exactly the SLO.

Looking more than once. The runner looks after every request and stops a point as soon as it
is decided; with the fixed-size thresholds that would let the errors grow past ``alpha`` (at
99% and 2,000 looks: 3.7% false passes and 7.7% false fails at ``p = 1 - q``). ``sequential``
therefore returns the rule with smaller per-look levels, found by bisection on the exact
probability (``sequential_error``, a dynamic programme over the overage count) that a point of
up to ``n_max`` requests, looked at after each, ever crosses the boundary wrongly; each error
of the sequential test is then at most ``alpha`` (computed for each boundary alone, which only
overstates it: a path the other boundary stops cannot cross this one later).
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, replace

import numpy as np
from scipy.stats import binom

from relaygr.errors import ConfigError


class Verdict(str, enum.Enum):
    """A point's P99 verdict (its value is the name written in reports)."""

    PASS = "pass"
    FAIL = "fail"
    UNDECIDED = "undecided"

    def __str__(self) -> str:
        return self.value


@functools.lru_cache(maxsize=256)
def _boundaries(n_max: int, tail: float, pass_alpha: float, fail_alpha: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """For n = 0..n_max: the most overages a pass allows (-1: none) and the fewest a fail
    needs (n + 1: none), as int arrays indexed by n."""
    n = np.arange(n_max + 1)
    k = binom.ppf(pass_alpha, n, tail)            # smallest k with P(M <= k) >= alpha
    allow = np.where(binom.cdf(k, n, tail) <= pass_alpha, k, k - 1)
    need = binom.ppf(1 - fail_alpha, n, tail) + 1    # P(M >= need) <= alpha
    allow[0], need[0] = -1, 1
    return allow.astype(np.int64), np.minimum(need, n + 1).astype(np.int64)


@dataclass(frozen=True)
class P99Rule:
    """The order-statistic decision of the module docstring, for quantile ``quantile``.

    ``pass_alpha`` / ``fail_alpha`` are the per-look levels (None: ``1 - confidence``, a single
    look); ``sequential`` sets them for looking after every request.
    """

    confidence: float = 0.99    # MLPerf's early-stopping confidence
    quantile: float = 0.99
    pass_alpha: float | None = None
    fail_alpha: float | None = None

    def __post_init__(self) -> None:
        if not 0.5 < self.confidence < 1 or not 0 < self.quantile < 1:
            raise ConfigError(f"P99Rule needs 0.5 < confidence < 1 and 0 < quantile < 1, got "
                              f"{self.confidence}, {self.quantile}")

    @property
    def tail(self) -> float:
        """The share of requests over the SLO at which the quantile sits exactly on it."""
        return 1.0 - self.quantile

    def _levels(self) -> tuple[float, float]:
        alpha = 1.0 - self.confidence
        return (alpha if self.pass_alpha is None else self.pass_alpha,
                alpha if self.fail_alpha is None else self.fail_alpha)

    def boundaries(self, n_max: int) -> tuple[np.ndarray, np.ndarray]:
        """(pass allowance, fail threshold) for every n in 0..n_max (see ``_boundaries``)."""
        return _boundaries(max(n_max, 1), self.tail, *self._levels())

    def verdict(self, n: int, overages: int) -> Verdict:
        if not 0 <= overages <= n:
            raise ConfigError(f"need 0 <= overages <= n, got {overages} of {n}")
        allow, need = self.boundaries(_bucket(n))
        if overages <= allow[n]:
            return Verdict.PASS
        if overages >= need[n]:
            return Verdict.FAIL
        return Verdict.UNDECIDED

    def min_samples_to_pass(self, overages: int = 0) -> int:
        """Fewest samples with ``overages`` overages that establish a pass."""
        n = max(overages + 1, math.ceil(math.log(self._levels()[0]) / math.log1p(-self.tail)))
        while self.verdict(n, overages) is not Verdict.PASS:
            n += 1
        return n

    def sequential(self, n_max: int) -> P99Rule:
        """This rule with per-look levels such that looking after each of up to ``n_max``
        requests (rounded up to a power of two: a few rules serve every point size) keeps each
        error of the whole test within ``1 - confidence``."""
        return _sequential(self.confidence, self.quantile, _bucket(n_max))


def _bucket(n: int) -> int:
    """The power of two at or above ``n`` (tables and rules are computed per bucket)."""
    return 1 << (max(n, 1) - 1).bit_length()


def sequential_error(rule: P99Rule, n_max: int, verdict: Verdict = Verdict.PASS) -> float:
    """Probability that a point looked at after every request reaches ``verdict`` wrongly by
    ``n_max`` requests, when the true overage share is exactly ``rule.tail`` (the worst case
    for either error), with only that verdict's boundary stopping the point."""
    allow, need = rule.boundaries(_bucket(n_max))
    width = int(need[n_max]) + 2 if verdict is Verdict.PASS else int(need[n_max]) + 1
    alive = np.zeros(width)
    alive[0] = 1.0          # alive[m]: P(m overages so far and not stopped yet)
    crossed, t = 0.0, rule.tail
    for n in range(1, n_max + 1):
        spill = alive[-1] * t   # mass leaving the table's top (only in the PASS case, ~0)
        alive[1:] = alive[1:] * (1 - t) + alive[:-1] * t
        alive[0] *= 1 - t
        alive[-1] += spill
        if verdict is Verdict.PASS:
            crossed += float(alive[: allow[n] + 1].sum())
            alive[: allow[n] + 1] = 0.0
        elif need[n] < width:
            crossed += float(alive[need[n]:].sum())
            alive[need[n]:] = 0.0
    return crossed


@functools.lru_cache(maxsize=64)
def _sequential(confidence: float, quantile: float, n_max: int) -> P99Rule:
    base = P99Rule(confidence, quantile)
    alpha = 1.0 - confidence
    levels = {}
    for verdict, name in ((Verdict.PASS, "pass_alpha"), (Verdict.FAIL, "fail_alpha")):
        lo, hi = alpha * 1e-4, alpha     # error(lo) <= alpha; find the largest such level
        for _ in range(30):
            mid = math.sqrt(lo * hi)
            trial = replace(base, **{name: mid})
            if sequential_error(trial, n_max, verdict) <= alpha:
                lo = mid
            else:
                hi = mid
        levels[name] = lo
    return replace(base, **levels)


@dataclass(frozen=True)
class P99Decision:
    """One point's verdict and the evidence for it: ``samples`` requests (unserved ones
    included), ``overages`` of them over the SLO, judged at ``confidence``."""

    verdict: Verdict
    samples: int
    overages: int
    confidence: float

    @classmethod
    def of(cls, rule: P99Rule, samples: int, overages: int) -> P99Decision:
        return cls(rule.verdict(samples, overages), samples, overages, rule.confidence)
