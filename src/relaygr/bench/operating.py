"""The fixed-length throughput comparison's operating point, relative to the measured machine.

A production ranking stage runs near its length cap: the history length at which one full
ranking pass takes most of the ranking SLO, leaving the rest to the wait behind other work. The
benchmark compares throughput at that point, found on the machine it runs on, so that the
comparison means the same on a slow CPU, a fast one and a GPU: the prefix length at which the
baseline's full ranking pass (prefix + suffix + candidates recomputed, one request, alone on one
instance's threads) takes ``slo_share`` of the SLO.

``find_operating_length`` measures that cost curve through a ``CostProbe``: from
``start_tokens`` it multiplies the length by ``growth`` while the pass costs less than the target
(or divides while it costs more) until two measured lengths bracket the target, then narrows the
bracket by linear interpolation (regula falsi) on measured costs until a length costs within
``tolerance`` of the target or ``max_refinements`` more lengths were measured. The answer is the
measured length whose cost is nearest the target; every measured (length, cost) is kept, in
measuring order. A machine so fast that the pass stays under the target up to ``max_tokens`` (the
longest the model reads) gets ``max_tokens``; one so slow that ``min_tokens`` already exceeds it
gets ``min_tokens``; ``bound`` says which case held. Lengths are multiples of ``quantum_tokens``.

The baseline at its best: at that length, the same probe times one model call over 2, 4, ...
users (up to ``max_batch``, until a call takes longer than the SLO), and the baseline's batch
cap for the throughput search is the batch that serves the most requests per second of compute
(B / its call's time) among the calls that fit within the SLO (a batch past it misses for every
request in it), a batch within ``tolerance`` of a smaller one's rate going to the smaller one
(it delays its first request less). Where a batch of B costs about B passes (a CPU at long
histories) that is 1; where batching is cheap (a GPU), more. The thread count is not searched:
every instance computes on its own share of the cores, the relay's too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rich.table import Table

from relaygr.errors import ConfigError


class CostProbe(Protocol):
    """Times the baseline's ranking pass alone."""

    def full_rank_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                     batch: int = 1) -> float:
        """Median ms of one model call of full ranking passes (prefix, suffix and candidates
        all computed) for ``batch`` users at once."""
        ...


@dataclass(frozen=True)
class CostSample:
    """The baseline's full pass measured at one prefix length."""

    prefix_tokens: int
    cost_ms: float


@dataclass(frozen=True)
class BatchSample:
    """One model call over ``batch`` users' full passes at the operating length."""

    batch: int
    cost_ms: float


@dataclass(frozen=True)
class OperatingPoint:
    """Where the fixed-length throughput comparison runs, and why (module docstring).

    ``cost_ms`` is the baseline's full pass measured at ``prefix_len`` (``suffix_tokens`` and
    ``candidates`` as in the workload) and ``share`` = ``cost_ms`` / ``slo_ms``, the share of
    the SLO it actually takes; ``bound`` is ``bracketed``, ``longest`` or ``shortest``.
    ``serving`` describes how the systems serve (instances, threads per instance, their batch
    cap): the probe times on one instance's threads. ``batch_curve`` holds the batched calls
    timed at ``prefix_len`` (batch 1 is ``cost_ms``) and ``baseline_batch`` the batch cap the
    baseline's throughput search runs with (module docstring).
    """

    prefix_len: int
    slo_ms: float
    slo_share: float
    target_ms: float
    cost_ms: float
    share: float
    suffix_tokens: int
    candidates: int
    bound: str
    curve: tuple[CostSample, ...]
    serving: Mapping[str, Any] = field(default_factory=dict)
    # The machine's noise while the curve was measured (``relaygr.bench.noise``): a busy host
    # makes every pass slower and so the length shorter.
    steal_fraction: float | None = None
    calibration_ms: float | None = None
    batch_curve: tuple[BatchSample, ...] = ()
    baseline_batch: int = 1

    @property
    def reason(self) -> str:
        """One sentence: why this length."""
        head = (f"the baseline's full ranking pass ({self.candidates} candidates, "
                f"{self.suffix_tokens} suffix tokens) takes {self.cost_ms:.1f} ms at "
                f"{self.prefix_len} prefix tokens, {self.share:.0%} of the {self.slo_ms:g} ms "
                f"SLO (target {self.slo_share:.0%})")
        if self.bound == "longest":
            head += ": under the target up to the longest length measured"
        elif self.bound == "shortest":
            head += ": over the target already at the shortest length measured"
        merged = ("one request a call" if self.baseline_batch == 1
                  else f"up to {self.baseline_batch} requests a call")
        return head + f"; the baseline's batch cap there: {merged}"


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

    def __post_init__(self) -> None:
        if not (0 < self.quantum_tokens <= self.min_tokens <= self.start_tokens
                <= self.max_tokens):
            raise ConfigError("LengthSearch needs 0 < quantum_tokens <= min_tokens <= "
                              "start_tokens <= max_tokens")
        if not (self.growth > 1 and 0 < self.tolerance < 1 and self.max_refinements >= 0
                and self.max_batch >= 1):
            raise ConfigError("LengthSearch needs growth > 1, tolerance in (0, 1), "
                              "max_refinements >= 0 and max_batch >= 1")

    def quantize(self, tokens: float) -> int:
        whole = round(tokens / self.quantum_tokens) * self.quantum_tokens
        return int(min(max(whole, self.min_tokens), self.max_tokens))


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


def operating_point(probe: CostProbe, slo_ms: float, slo_share: float, suffix_tokens: int,
                    candidates: int, search: LengthSearch,
                    serving: Mapping[str, Any] | None = None) -> OperatingPoint:
    """Measure the baseline's cost curve through ``probe`` and choose the length."""
    if not 0 < slo_share < 1:
        raise ConfigError(f"slo_share must be in (0, 1), got {slo_share}")
    target = slo_share * slo_ms
    chosen, bound, curve = find_operating_length(
        lambda tokens: probe.full_rank_ms(tokens, suffix_tokens, candidates), target, search)
    batches = [BatchSample(1, chosen.cost_ms)]
    while (size := 2 * batches[-1].batch) <= search.max_batch \
            and batches[-1].cost_ms <= slo_ms:
        batches.append(BatchSample(size, probe.full_rank_ms(chosen.prefix_tokens, suffix_tokens,
                                                            candidates, batch=size)))
    best = batches[0]
    for b in batches[1:]:
        if b.cost_ms <= slo_ms and \
                b.batch / b.cost_ms > (1 + search.tolerance) * best.batch / best.cost_ms:
            best = b
    return OperatingPoint(chosen.prefix_tokens, slo_ms, slo_share, target, chosen.cost_ms,
                          chosen.cost_ms / slo_ms, suffix_tokens, candidates, bound, curve,
                          dict(serving or {}), batch_curve=tuple(batches),
                          baseline_batch=best.batch)


def operating_table(point: OperatingPoint) -> Table:
    """The console's account of the operating point: the measured curve and the choice."""
    serving = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in point.serving.items())
    table = Table(title=f"fixed-length operating point: {point.prefix_len} tokens, where the "
                        f"baseline's full pass alone takes {point.slo_share:.0%} of the SLO"
                        + (f" (every mode serves on {serving}; the baseline's batch cap "
                           "in its throughput search is marked below)" if serving else ""))
    if point.calibration_ms is not None:
        steal = "n/a" if point.steal_fraction is None else f"{point.steal_fraction:.0%}"
        table.caption = (f"measured at {steal} steal, calibration {point.calibration_ms:.2f} "
                         "ms")
    for column in ("prefix tokens", "full pass ms", "share of SLO", ""):
        table.add_column(column, justify="right")
    for sample in sorted(point.curve, key=lambda s: s.prefix_tokens):
        chosen = "chosen" if sample.prefix_tokens == point.prefix_len else ""
        table.add_row(str(sample.prefix_tokens), f"{sample.cost_ms:.1f}",
                      f"{sample.cost_ms / point.slo_ms:.0%}", chosen)
    for b in point.batch_curve[1:]:
        chosen = "baseline's batch cap" if b.batch == point.baseline_batch else ""
        table.add_row(f"{point.prefix_len} x {b.batch} users", f"{b.cost_ms:.1f}",
                      f"{b.cost_ms / point.slo_ms:.0%}", chosen)
    if point.baseline_batch == 1:
        table.add_row(f"{point.prefix_len} x 1 user", f"{point.cost_ms:.1f}",
                      f"{point.share:.0%}", "baseline's batch cap")
    return table
