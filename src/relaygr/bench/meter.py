"""``PointMeter``: one benchmark point measured and recorded, for every phase of a run.

A point is one mode at one rate on one workload, on a system built for it alone. The meter
builds the point's requests (the lock-step round of every mode at a point shares them), runs the
point, reads the host's noise around it, records its statistics and P99 verdict (``points``,
the journal, the progress line) and measures a point that did not pass under noise again after
the host quietens (``BenchConfig.budget``: ``max_remeasures``, ``remeasure_steal``,
``remeasure_slowdown``), every attempt kept.

It also keeps the run's deadline (``BenchSuite``'s module docstring): a point fits when its
schedule plus the longest set-up and drain of any point so far ends by it.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Mapping
from dataclasses import replace

from relaygr.bench.config import BenchConfig
from relaygr.bench.decision import P99Rule
from relaygr.bench.journal import Journal
from relaygr.bench.layout import Layout
from relaygr.bench.noise import (
    QUIET_PATIENCE_S,
    NoiseMonitor,
    PointNoise,
    wait_for_quiet_host,
)
from relaygr.bench.progress import Progress
from relaygr.bench.protocol import SystemFactory
from relaygr.bench.runner import RunOptions, run_point
from relaygr.bench.search import Outcome
from relaygr.bench.stats import PointStats, point_stats
from relaygr.bench.workload import Workload, WorkloadBuilder, summarize


class PointMeter:
    """Measures the points of one run; ``points`` holds every attempt, in order."""

    def __init__(self, systems: Mapping[str, SystemFactory], config: BenchConfig,
                 progress: Progress, journal: Journal | None = None) -> None:
        self.systems, self.config = dict(systems), config
        self.progress, self.journal = progress, journal
        self.points: list[PointStats] = []
        self.summaries: dict[str, dict[str, object]] = {}
        # (mode, phase) -> the batch cap and the layout its systems are built with (the
        # operating point's)
        self.batch_caps: dict[tuple[str, str], int] = {}
        self.layouts: dict[tuple[str, str], Layout] = {}
        self.noise = NoiseMonitor(config.budget.remeasure_steal,
                                  config.budget.remeasure_slowdown)
        self._workloads: OrderedDict[tuple[str, int | None, float], Workload] = OrderedDict()
        # How often each (mode, phase, QPS, length) was measured: a search's second measurement
        # of a point is its re-measure of a deciding fail (``PointStats.round``).
        self._rounds: Counter[tuple[str, str, float, int | None]] = Counter()
        # the run's deadline on the loop's clock (``start_deadline``), and the longest a point
        # has taken beyond its schedule so far (building its system, draining it)
        self._deadline_at: float | None = None
        self._setup_s = 0.0

    def start_deadline(self, seconds: float) -> None:
        """The run ends ``seconds`` from now on the running loop's clock."""
        self._deadline_at = asyncio.get_running_loop().time() + seconds

    def workload(self, phase: str, builder: WorkloadBuilder, qps: float,
                 prefix_len: int | None) -> Workload:
        """The requests of a point of ``phase`` at ``qps``, built once for every mode."""
        key = (phase, prefix_len, qps)
        if key not in self._workloads:
            budget = self.config.budget
            total = budget.warmup_at(qps) + budget.measured_at(qps)
            self._workloads[key] = builder.build(qps, total)
            self.summaries.setdefault(phase, summarize(self._workloads[key]).to_dict())
            while len(self._workloads) > 2:  # the lock-step round reuses only the latest
                self._workloads.popitem(last=False)
        return self._workloads[key]

    async def measure(self, mode: str, phase: str, builder: WorkloadBuilder, qps: float,
                      prefix_len: int | None = None) -> PointStats:
        """Run one point of ``mode`` and record its statistics and P99 verdict; a point that did
        not pass while the host was noisy (``_noisy``) is measured again after the host
        quietens, up to ``max_remeasures`` times, every attempt recorded."""
        workload = self.workload(phase, builder, qps, prefix_len)
        budget, slo_ms = self.config.budget, self.config.slo_ms
        options = RunOptions(
            warmup_requests=budget.warmup_at(qps), max_in_flight=budget.max_in_flight,
            drain_timeout_s=budget.drain_timeout_s, slo_ms=slo_ms,
            rule=P99Rule(budget.confidence), stop_when_decided=budget.stop_when_decided)
        key = (mode, phase, qps, prefix_len)
        self._rounds[key] += 1
        length = "" if prefix_len is None else f" len {prefix_len}"
        again = " (again: it decides the answer)" if self._rounds[key] > 1 else ""
        label = f"{phase} {mode}{length} @ {qps:.3g} QPS{again}"
        factory = self.systems[mode]
        cap, layout = self.batch_caps.get((mode, phase)), self.layouts.get((mode, phase))
        if cap is not None or layout is not None:
            factory = _placed(factory, cap, layout)
        for attempt in range(1, budget.max_remeasures + 2):
            self.progress.start_point(label, len(workload.requests))
            before = self.noise.begin()
            started = asyncio.get_running_loop().time()
            result = await run_point(factory, workload, options, self.progress)
            elapsed = asyncio.get_running_loop().time() - started
            # what the point took beyond its requests' schedule: building and starting the
            # system, the drain, the stop (a point stopped once decided ran part of it)
            ran_s = min(result.duration_s, workload.requests[-1].send_s)
            self._setup_s = max(self._setup_s, elapsed - ran_s)
            noise = self.noise.end(before)
            self.progress.end_point()
            stats = replace(point_stats(result, mode, phase, qps, prefix_len),
                            steal_fraction=noise.steal_fraction,
                            calibration_ms=noise.calibration_ms, attempt=attempt,
                            round=self._rounds[key])
            self._record(stats, label)
            if stats.passed or not self._noisy(stats):
                break
            if attempt <= budget.max_remeasures:
                # wait for a quiet host only as long as the point would still end in time: a
                # wait that spent all of that slack leaves no time to measure again
                patience = min(QUIET_PATIENCE_S, self._slack_s(workload))
                quiet = await wait_for_quiet_host(budget.remeasure_steal, patience_s=patience)
                if (not quiet and patience < QUIET_PATIENCE_S) or not self.fits(workload):
                    self.progress.note(f"{label}: not measured again under noise "
                                       f"({noise.describe()}): it would end past the run's "
                                       "deadline")
                    break
                self.progress.note(f"{label}: measuring again (noise during the point: "
                                   f"{noise.describe()})")
        return stats

    async def outcome(self, measuring: Awaitable[PointStats]) -> Outcome:
        """The search's view of a measured point; its cost is every attempt's run time."""
        first = len(self.points)
        stats = await measuring
        return Outcome(stats.ranking.p99_ms, stats.verdict,
                       sum(p.duration_s for p in self.points[first:]))

    def _slack_s(self, workload: Workload) -> float:
        """Seconds a point sending ``workload`` would end before the run's deadline (inf: no
        deadline): what is left, less its schedule and the longest a point took beyond its
        schedule so far."""
        if self._deadline_at is None:
            return math.inf
        left = self._deadline_at - asyncio.get_running_loop().time()
        return left - workload.requests[-1].send_s - self._setup_s

    def fits(self, workload: Workload) -> bool:
        """Whether a point sending ``workload`` would end by the run's deadline."""
        return self._slack_s(workload) >= 0

    def _noisy(self, stats: PointStats) -> bool:
        """Too much noise during the point to believe that it did not pass (``noise``)."""
        return self.noise.too_noisy(stats.steal_fraction, stats.calibration_ms)

    def add(self, stats: PointStats) -> None:
        """Keep a measured point (and journal it)."""
        self.points.append(stats)
        if self.journal is not None:
            self.journal.point(stats)

    def _record(self, stats: PointStats, label: str) -> None:
        self.add(stats)
        decision = stats.decision
        evidence = "" if decision is None else \
            f" ({decision.overages} over the SLO in {decision.samples})"
        self.progress.note(f"{label}: ranking p50 {stats.ranking.p50_ms:.1f} / p99 "
                           f"{stats.ranking.p99_ms:.1f} ms, {stats.verdict}{evidence}, "
                           f"{_noise(stats)}")


def _placed(factory: SystemFactory, cap: int | None, layout: Layout | None) -> SystemFactory:
    return lambda ctx: factory(replace(ctx, batch_max_requests=cap, layout=layout))


def _noise(stats: PointStats) -> str:
    if stats.calibration_ms is None:
        return "noise not measured"
    return PointNoise(stats.steal_fraction, stats.calibration_ms).describe()
