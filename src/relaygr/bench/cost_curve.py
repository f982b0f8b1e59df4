"""The baseline's cost curve: its full ranking pass timed over prefix lengths until one length
costs the operating point's target (``bench.operating``).

``find_operating_length`` measures that cost curve through a ``CostProbe``: from
``start_tokens`` it multiplies the length by ``growth`` while the pass costs less than the target
(or divides while it costs more) until two measured lengths bracket the target, then narrows the
bracket by linear interpolation (regula falsi) on measured costs until a length costs within
``tolerance`` of the target or ``max_refinements`` more lengths were measured. The answer is the
measured length whose cost is nearest the target; every measured (length, cost) is kept, in
measuring order. A machine so fast that the pass stays under the target up to ``max_tokens`` (the
longest the model reads) gets ``max_tokens``; one so slow that ``min_tokens`` already exceeds it
gets ``min_tokens``; ``bound`` says which case held. Lengths are multiples of ``quantum_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from relaygr.errors import BenchProtocolError, ConfigError

# Passes timed at each length of the cost curve at least, in all (a quantile read off fewer
# would be a single pass's).
MIN_CURVE_PASSES = 9


@dataclass(frozen=True)
class CostSample:
    """The baseline's full pass measured at one prefix length: ``cost_ms`` is the curve's
    quantile of its passes (``LengthSearch.quantile``)."""

    prefix_tokens: int
    cost_ms: float


@dataclass(frozen=True)
class LengthSearch:
    """How the cost curve is walked (module docstring)."""

    start_tokens: int = 256
    min_tokens: int = 32
    max_tokens: int = 8192
    growth: float = 2.0
    tolerance: float = 0.05
    max_refinements: int = 4
    quantum_tokens: int = 16
    # Batches timed for the baseline's batch cap: 2, 4, ... up to this (1: not searched).
    max_batch: int = 8
    # The curve's statistic: this quantile of each length's passes (module docstring).
    quantile: float = 0.99

    def __post_init__(self) -> None:
        if not (0 < self.quantum_tokens <= self.min_tokens <= self.start_tokens
                <= self.max_tokens):
            raise ConfigError("LengthSearch needs 0 < quantum_tokens <= min_tokens <= "
                              "start_tokens <= max_tokens")
        if not (self.growth > 1 and 0 < self.tolerance < 1 and self.max_refinements >= 0
                and self.max_batch >= 1 and 0 < self.quantile < 1):
            raise ConfigError("LengthSearch needs growth > 1, tolerance in (0, 1), "
                              "max_refinements >= 0, max_batch >= 1 and quantile in (0, 1)")

    @property
    def passes(self) -> int:
        """Passes timed at each length: enough that the ``quantile`` by nearest rank is not
        the slowest (1 / (1 - quantile)), and at least ``MIN_CURVE_PASSES``."""
        return max(MIN_CURVE_PASSES, math.ceil(1 / (1 - self.quantile) - 1e-9))

    def read(self, samples: Sequence[float]) -> float:
        """The ``quantile`` of ``samples`` by nearest rank (as ``bench.stats.percentile``)."""
        if not samples:
            raise BenchProtocolError("the cost probe returned no timed pass")
        return float(np.percentile(samples, 100 * self.quantile, method="inverted_cdf"))

    def quantize(self, tokens: float) -> int:
        whole = round(tokens / self.quantum_tokens) * self.quantum_tokens
        return int(min(max(whole, self.min_tokens), self.max_tokens))

    def capped(self, cap_tokens: int) -> LengthSearch:
        """This walk going no longer than ``cap_tokens`` (rounded down to the quantum)."""
        cap = max(cap_tokens // self.quantum_tokens * self.quantum_tokens, self.quantum_tokens)
        if cap >= self.max_tokens:
            return self
        return replace(self, max_tokens=cap, start_tokens=min(self.start_tokens, cap),
                       min_tokens=min(self.min_tokens, cap))


def find_operating_length(cost_ms: Callable[[int], float], target_ms: float,
                          search: LengthSearch) -> tuple[CostSample, str, tuple[CostSample, ...]]:
    """(chosen, bound, curve): the measured length whose cost is nearest ``target_ms``, which
    case held, and every length measured, in order."""
    if not target_ms > 0:
        raise ConfigError(f"the operating point's target must be > 0 ms, got {target_ms}")
    curve: list[CostSample] = []

    def measure(tokens: int) -> CostSample:
        sample = CostSample(tokens, float(cost_ms(tokens)))
        curve.append(sample)
        return sample

    def nearest() -> CostSample:
        return min(curve, key=lambda s: abs(s.cost_ms - target_ms))

    first = measure(search.quantize(search.start_tokens))
    below, above = (first, None) if first.cost_ms < target_ms else (None, first)
    while above is None:                       # climb until a length costs the target
        assert below is not None
        if below.prefix_tokens >= search.max_tokens:
            return below, "longest", tuple(curve)
        sample = measure(search.quantize(below.prefix_tokens * search.growth))
        below, above = (sample, None) if sample.cost_ms < target_ms else (below, sample)
    while below is None:                       # descend until a length costs less
        assert above is not None
        if above.prefix_tokens <= search.min_tokens:
            return above, "shortest", tuple(curve)
        sample = measure(search.quantize(above.prefix_tokens / search.growth))
        below, above = (sample, above) if sample.cost_ms < target_ms else (None, sample)
    assert above is not None
    for _ in range(search.max_refinements):
        if abs(nearest().cost_ms - target_ms) <= search.tolerance * target_ms:
            break
        slope = (above.cost_ms - below.cost_ms) / (above.prefix_tokens - below.prefix_tokens)
        tokens = search.quantize(below.prefix_tokens + (target_ms - below.cost_ms) / slope)
        if not below.prefix_tokens < tokens < above.prefix_tokens:
            break                               # the bracket is one quantum wide
        sample = measure(tokens)
        if sample.cost_ms < target_ms:
            below = sample
        else:
            above = sample
    return nearest(), "bracketed", tuple(curve)
