"""The fixed-length throughput comparison's operating point, relative to the measured machine.

A production ranking stage runs near its length cap: the history length at which one full
ranking pass takes most of the ranking SLO, leaving the rest to the wait behind other work. The
benchmark compares throughput at that point, found on the machine it runs on, so that the
comparison means the same on a slow CPU, a fast one and a GPU: the prefix length at which the
baseline's full ranking pass (prefix + suffix + candidates recomputed, one request) takes
``slo_share`` of the SLO where the baseline serves: the probe decides where it times. The cost
read off the curve is a high quantile of the pass (``LengthSearch.quantile``, default 0.99), not
its median: the SLO bounds the P99 of ranking latency, so the share is of the pass's P99 too.
A pass whose median takes half the SLO has a P99 well over half before any queueing, and a
length chosen by the median can leave the baseline holding its P99 at no load at all
(docs/benchmark.md, "The operating point"). Each length is timed
``LengthSearch.passes`` times (enough that the quantile is not the slowest pass: 100 for the
P99) and the quantile read by nearest rank. On CPU instances in processes,
``relaygr.bench.instance_probe`` times it in processes set up as the instances, all of them
computing at once (the cost an instance pays near its throughput); a probe of the pass alone in
the benchmark's process (``relaygr.bench.limit``) times less.

The curve is walked by ``bench.cost_curve.find_operating_length`` (``LengthSearch``).

Never past the baseline's length cap: the probe times the pass apart from the serving (no load
generator, no cascade stages beside it, passes back to back), and on a busy or drifting machine
the served pass can cost more than the curve says, so the length where the curve meets the
target can lie where the baseline, serving, holds its P99 at no rate at all (no comparison of
throughputs then: the ratio has no upper bound). Given ``cap_tokens`` (the suite passes the
longest grid length the baseline's own length sweep did not fail at, at the sweep's load), the
walk goes no longer than that; a cap that stops it is ``bound`` ``capped``.

The baseline at its best: at that length, the same probe times one model call over 1, 2, 4,
... users (up to ``max_batch``, until a call takes longer than the SLO; the median of a few
calls each: a rate of requests served, not a tail), and the baseline's batch cap for the
throughput search is the batch that serves the most requests per second of compute
(B / its call's time) among the calls that fit within the SLO (a batch past it misses for every
request in it), a batch within ``tolerance`` of a smaller one's rate going to the smaller one
(it delays its first request less). Where a batch of B costs about B passes (a CPU at long
histories) that is 1; where batching is cheap (a GPU), more.

The baseline's layout: where the probe is a ``LayoutProbe`` (it times a ``Layout``, K instances
of T threads each, with all K computing at once), the same cores are also split the other ways
(every K x T with the same product: on 2 cores, 2 x 1 and 1 x 2) and timed at the operating
length and batch cap; the baseline's layout is the one serving the most requests per second of
compute (K x B / the call's time) among those whose call fits within the SLO, another layout
than the serving one only when it is more than ``tolerance`` ahead of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from relaygr.bench.cost_curve import CostSample, LengthSearch, find_operating_length
from relaygr.bench.layout import Layout
from relaygr.errors import ConfigError


class CostProbe(Protocol):
    """Times the baseline's ranking pass."""

    def full_rank_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                     batch: int = 1) -> float:
        """Median ms of one model call of full ranking passes (prefix, suffix and candidates
        all computed) for ``batch`` users at once."""
        ...

    def full_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                             passes: int) -> list[float]:
        """Ms of each of at least ``passes`` model calls of one user's full ranking pass,
        timed as ``full_rank_ms`` times them."""
        ...


@runtime_checkable
class LayoutProbe(CostProbe, Protocol):
    """A ``CostProbe`` that times on a layout: ``full_rank_ms`` on ``layout`` (the serving one),
    ``layout_rank_ms`` on any, every instance of it computing at once."""

    layout: Layout

    def layout_rank_ms(self, layout: Layout, prefix_tokens: int, suffix_tokens: int,
                       candidates: int, batch: int = 1) -> float:
        ...


@dataclass(frozen=True)
class BatchSample:
    """One model call over ``batch`` users' full passes at the operating length."""

    batch: int
    cost_ms: float

    @property
    def requests_per_s(self) -> float:
        """Requests a second of this call's compute."""
        return self.batch / self.cost_ms * 1e3


@dataclass(frozen=True)
class LayoutSample:
    """One instance's call of ``batch`` full passes at the operating length, every instance of
    ``layout`` computing at once."""

    layout: Layout
    batch: int
    cost_ms: float

    @property
    def requests_per_s(self) -> float:
        """Requests a second of compute over all the layout's instances."""
        return self.layout.instances * self.batch / self.cost_ms * 1e3


@dataclass(frozen=True)
class OperatingPoint:
    """Where the fixed-length throughput comparison runs, and why (module docstring).

    ``cost_ms`` is the ``quantile`` of the baseline's full pass measured at ``prefix_len``
    (``suffix_tokens`` and ``candidates`` as in the workload) and ``share`` = ``cost_ms`` /
    ``slo_ms``, the share of the SLO it actually takes; ``bound`` is ``bracketed``,
    ``longest``, ``capped`` (``cap_tokens``, the baseline's length cap, stopped the walk) or
    ``shortest``.
    ``serving`` describes how the systems serve (instances, threads per instance, their batch
    cap): the probe times on one instance's threads. ``batch_curve`` holds the batched calls
    timed at ``prefix_len`` (medians; batch 1 is the pass's median) and ``baseline_batch``
    the batch cap the baseline's throughput search runs with (module docstring);
    ``layout_curve`` the layouts timed there (empty: not searched) and ``baseline_layout``
    the one chosen; ``quantile``, the curve's statistic (``LengthSearch.quantile``).
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
    layout_curve: tuple[LayoutSample, ...] = ()
    baseline_layout: Layout | None = None
    quantile: float = 0.5
    # The baseline's length cap the walk was held to (None: none given)
    cap_tokens: int | None = None

    @property
    def baseline_requests_per_s(self) -> float | None:
        """Requests a second of the baseline's compute at this length as it serves: its
        layout's instances each computing a call of its batch cap (``layout_curve``), else one
        instance's calls of that batch (``batch_curve``) times the serving instances; None
        when neither was timed."""
        for sample in self.layout_curve:
            if sample.layout == self.baseline_layout and sample.batch == self.baseline_batch:
                return sample.requests_per_s
        for batch in self.batch_curve:
            if batch.batch == self.baseline_batch:
                return batch.requests_per_s * int(self.serving.get("instances", 1))
        return None

    @property
    def statistic(self) -> str:
        """The curve's statistic, as a percentile's name: P99, P50."""
        return f"P{100 * self.quantile:g}"

    @property
    def median_ms(self) -> float | None:
        """The pass's median at ``prefix_len`` (one user a call), where the batches were
        timed."""
        return self.batch_curve[0].cost_ms if self.batch_curve else None

    @property
    def reason(self) -> str:
        """One sentence: why this length."""
        median = "" if self.median_ms is None else f", median {self.median_ms:.1f} ms"
        head = (f"the {self.statistic} of the baseline's full ranking pass "
                f"({self.candidates} candidates, {self.suffix_tokens} suffix tokens) is "
                f"{self.cost_ms:.1f} ms at {self.prefix_len} prefix tokens{median}, "
                f"{self.share:.0%} of the {self.slo_ms:g} ms SLO (target "
                f"{self.slo_share:.0%})")
        if self.bound == "longest":
            head += ": under the target up to the longest length measured"
        elif self.bound == "capped":
            head += (f": under the target up to {self.cap_tokens} tokens, the baseline's length "
                     "cap (the longest length its sweep did not fail at)")
        elif self.bound == "shortest":
            head += ": over the target already at the shortest length measured"
        merged = ("one request a call" if self.baseline_batch == 1
                  else f"up to {self.baseline_batch} requests a call")
        head += f"; the baseline's batch cap there: {merged}"
        if self.baseline_layout is not None and self.layout_curve:
            head += f"; its layout: {self.baseline_layout}"
        return head


def operating_point(probe: CostProbe, slo_ms: float, slo_share: float, suffix_tokens: int,
                    candidates: int, search: LengthSearch,
                    serving: Mapping[str, Any] | None = None,
                    cap_tokens: int | None = None) -> OperatingPoint:
    """Measure the baseline's cost curve through ``probe`` and choose the length, no longer
    than ``cap_tokens`` when given (module docstring)."""
    if not 0 < slo_share < 1:
        raise ConfigError(f"slo_share must be in (0, 1), got {slo_share}")
    target = slo_share * slo_ms
    walk = search if cap_tokens is None else search.capped(cap_tokens)

    def cost_ms(tokens: int) -> float:
        return search.read(probe.full_rank_samples_ms(tokens, suffix_tokens, candidates,
                                                      search.passes))

    chosen, bound, curve = find_operating_length(cost_ms, target, walk)
    if bound == "longest" and walk.max_tokens < search.max_tokens:
        bound = "capped"
    batches = [BatchSample(1, probe.full_rank_ms(chosen.prefix_tokens, suffix_tokens,
                                                 candidates))]
    while (size := 2 * batches[-1].batch) <= search.max_batch \
            and batches[-1].cost_ms <= slo_ms:
        batches.append(BatchSample(size, probe.full_rank_ms(chosen.prefix_tokens, suffix_tokens,
                                                            candidates, batch=size)))
    best = _most_served(batches, slo_ms, search.tolerance)
    layouts, layout = _layouts(probe, chosen.prefix_tokens, suffix_tokens, candidates,
                               best, slo_ms, search.tolerance)
    return OperatingPoint(chosen.prefix_tokens, slo_ms, slo_share, target, chosen.cost_ms,
                          chosen.cost_ms / slo_ms, suffix_tokens, candidates, bound, curve,
                          dict(serving or {}), batch_curve=tuple(batches),
                          baseline_batch=best.batch, layout_curve=layouts,
                          baseline_layout=layout, quantile=search.quantile,
                          cap_tokens=cap_tokens)


def _layouts(probe: CostProbe, prefix_tokens: int, suffix_tokens: int, candidates: int,
             batch: BatchSample, slo_ms: float, tolerance: float
             ) -> tuple[tuple[LayoutSample, ...], Layout | None]:
    """The layouts timed at the operating point and the baseline's (module docstring)."""
    if not isinstance(probe, LayoutProbe):
        return (), None
    serving = probe.layout
    samples = [LayoutSample(serving, batch.batch, batch.cost_ms)]
    samples += [LayoutSample(other, batch.batch,
                             probe.layout_rank_ms(other, prefix_tokens, suffix_tokens,
                                                  candidates, batch.batch))
                for other in serving.splits() if other != serving]
    return tuple(samples), _most_served(samples, slo_ms, tolerance).layout


Served = TypeVar("Served", BatchSample, LayoutSample)


def _most_served(samples: Sequence[Served], slo_ms: float, tolerance: float) -> Served:
    """The sample serving the most requests per second of compute among those whose call fits
    within the SLO; a later sample replaces an earlier one only when more than ``tolerance``
    ahead of it (the first is the default: one request a call, the serving layout)."""
    best = samples[0]
    for sample in samples[1:]:
        if sample.cost_ms <= slo_ms and \
                sample.requests_per_s > (1 + tolerance) * best.requests_per_s:
            best = sample
    return best
