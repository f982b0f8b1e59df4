"""``run_benchmark``: every phase of the benchmark over every mode, alternating point by point.

Phases, in order (each skipped when its config is None):
1. length sweep at fixed QPS -> ``max_seq_len_under_slo`` per mode;
   the operating point: the baseline's full-pass cost curve on this machine, through the cost
   probe, and the length where it takes the configured share of the SLO (``operating``), no
   longer than the baseline's length cap the sweep found;
2. QPS search at a fixed prefix length (the operating point's) -> ``slo_throughput_qps``;
3. QPS search on the mixed workload -> ``slo_throughput_qps_mixed``;
4. QPS searches on each extra workload (``config.workloads``: ML-1M replay, DLRMv3 with and
   without cross-request reuse, ...) for the systems it names;
5. the physical limit (low-load point of one mode + the isolated probe + matmul peak);
6. exactness (the same requests through two modes).
Every measured point builds a fresh system from the mode's factory; every mode at one point sees
the identical workload (same seed, QPS and size). The points themselves are measured, checked for
noise and recorded by the suite's ``meter`` (``bench.meter.PointMeter``).

The run's deadline (``BenchConfig.deadline_s``, on the event loop's clock from the start of
``run``): phases 1-4 propose a point, or measure one again under noise, only when it would end
by then: its schedule (warm-up and measured requests at its rate) plus the longest set-up and
drain of any point so far in the run. A search with a point that does not fit is halted and
says so (``stopped_by: deadline``); the phases after it (5, 6) are fixed in size and not cut,
so a plan sets the deadline to leave them their time. Without one, each search's own
``budget_s`` bounds it alone (and can overrun by one point).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from dataclasses import replace

from relaygr.bench.alternate import run_lockstep
from relaygr.bench.assemble import Phases, assemble
from relaygr.bench.config import BenchConfig, QpsSearchConfig, ThroughputConfig
from relaygr.bench.exactness import ExactnessReport, replay_exactness
from relaygr.bench.journal import Journal
from relaygr.bench.limit import LimitProbe, isolated_passes, limit_report
from relaygr.bench.meter import PointMeter
from relaygr.bench.operating import CostProbe, OperatingPoint, operating_point
from relaygr.bench.progress import NullProgress, Progress
from relaygr.bench.protocol import RELAYED_PATHS, SystemFactory
from relaygr.bench.qps_search import QpsSearch, QpsSearchResult
from relaygr.bench.report import BenchReport, LimitReport
from relaygr.bench.runner import RunOptions, run_point
from relaygr.bench.search import LengthSweepResult, Outcome
from relaygr.bench.stats import PointStats, compute_by_path, latency_parts, point_stats
from relaygr.bench.workload import SyntheticWorkload, WorkloadBuilder, workload_builder
from relaygr.errors import ConfigError


class BenchSuite:
    """Runs the phases of one benchmark; its ``meter`` measures and keeps every point."""

    def __init__(self, systems: Mapping[str, SystemFactory], config: BenchConfig,
                 probe: LimitProbe | None = None, progress: Progress | None = None,
                 peak_gflops: float | None = None,
                 extra_systems: Mapping[str, SystemFactory] | None = None,
                 cost_probe: CostProbe | None = None, journal: Journal | None = None) -> None:
        if not systems:
            raise ConfigError("run_benchmark needs at least one mode")
        self.systems, self.config, self.probe = dict(systems), config, probe
        self.cost_probe = cost_probe
        extra = dict(extra_systems or {})
        for phase in config.workloads:
            unknown = set(phase.modes) - set(self.systems) - set(extra)
            if unknown:
                raise ConfigError(f"workload phase {phase.name!r} names unknown systems "
                                  f"{sorted(unknown)}")
        self.progress = progress or NullProgress()
        self.journal = journal
        self.peak_gflops = peak_gflops
        self.meter = PointMeter({**extra, **self.systems}, config, self.progress, journal)

    @property
    def points(self) -> list[PointStats]:
        """Every measured point of the run, in order (the meter's)."""
        return self.meter.points

    def _fixed(self, prefix_len: int) -> SyntheticWorkload:
        return SyntheticWorkload(self.config.population.with_fixed_length(prefix_len),
                                 self.config.seed)

    def _finished(self, phase: str, result: object) -> None:
        if self.journal is not None and result is not None:
            self.journal.phase(phase, result)

    async def sweep(self) -> dict[str, LengthSweepResult]:
        cfg = self.config.sweep
        assert cfg is not None
        searches = {m: cfg.search(m) for m in cfg.swept(tuple(self.systems))}
        builders: dict[int, SyntheticWorkload] = {}

        def fixed(length: int) -> SyntheticWorkload:
            if length not in builders:
                builders[length] = self._fixed(length)
            return builders[length]

        async def measure(mode: str, length: int) -> Outcome:
            return await self.meter.outcome(self.meter.measure(mode, "sweep", fixed(length),
                                                               cfg.qps, length))

        def fits(length: int) -> bool:
            return self.meter.fits(self.meter.workload("sweep", fixed(length), cfg.qps, length))

        await run_lockstep(searches, measure, fits=fits)
        return {m: s.result() for m, s in searches.items()}

    async def qps_search(self, phase: str, builder: WorkloadBuilder, cfg: QpsSearchConfig,
                         prefix_len: int | None, modes: tuple[str, ...] | None = None
                         ) -> dict[str, QpsSearchResult]:
        searches = {
            m: QpsSearch(cfg.start_qps, cfg.growth, cfg.rel_tol, cfg.budget_s, cfg.min_qps,
                         cfg.max_qps) for m in (modes or tuple(self.systems))}

        async def measure(mode: str, qps: float) -> Outcome:
            return await self.meter.outcome(self.meter.measure(mode, phase, builder, qps,
                                                               prefix_len))

        await run_lockstep(searches, measure,
                           fits=lambda qps: self.meter.fits(
                               self.meter.workload(phase, builder, qps, prefix_len)))
        return {m: s.result() for m, s in searches.items()}

    def operating_point(self, sweep: dict[str, LengthSweepResult] | None = None
                        ) -> OperatingPoint | None:
        """This machine's operating point, when the plan asks for one and a probe can time it;
        no longer than the baseline's length cap in ``sweep`` (``baseline_length_cap``)."""
        cfg = self.config.throughput
        if cfg is None or cfg.prefix_len is not None or cfg.slo_share is None \
                or self.cost_probe is None:
            return None
        population = self.config.population
        before = self.meter.noise.begin()
        point = operating_point(self.cost_probe, self.config.slo_ms, cfg.slo_share,
                                round(population.recent_events_mean), population.num_candidates,
                                cfg.lengths, self.config.serving, baseline_length_cap(sweep))
        noise = self.meter.noise.end(before)
        point = replace(point, steal_fraction=noise.steal_fraction,
                        calibration_ms=noise.calibration_ms)
        curve = ", ".join(f"{s.prefix_tokens}: {s.cost_ms:.1f}" for s in point.curve)
        self.progress.note(f"operating point: {point.prefix_len} tokens ({point.reason}); "
                           f"full pass {point.statistic} ms by length: {curve}; "
                           f"{noise.describe()}")
        return point

    def throughput_search(self, cfg: ThroughputConfig, point: OperatingPoint | None
                          ) -> QpsSearchConfig:
        """``cfg.search`` started near the baseline's capacity at ``point`` (the operating
        point, where the throughput phase runs at its length; ``ThroughputConfig.search_near``)."""
        capacity = None if point is None else point.baseline_requests_per_s
        search = cfg.search_near(capacity)
        if point is not None and capacity is not None and cfg.start_capacity_share is not None:
            self.progress.note(f"throughput searches start at {search.start_qps:g} QPS: "
                               f"{cfg.start_capacity_share:g} of the baseline's "
                               f"{capacity:.0f} req/s of compute at {point.prefix_len} tokens, "
                               f"on the grid from {cfg.search.start_qps:g}")
        return search

    def throughput_prefix_len(self, sweep: dict[str, LengthSweepResult] | None,
                              point: OperatingPoint | None = None) -> tuple[int, str]:
        """The fixed length of phase 2 and why it was chosen."""
        cfg = self.config.throughput
        if cfg is not None and cfg.prefix_len is not None:
            return cfg.prefix_len, "configured"
        if point is not None:
            return point.prefix_len, f"operating point: {point.reason}"
        if sweep and "baseline" in sweep and sweep["baseline"].max_seq_len:
            return sweep["baseline"].max_seq_len, "longest sweep length baseline serves in SLO"
        grid = self.config.sweep.lengths if self.config.sweep else (1024,)
        return grid[0], "first sweep length (baseline passed none)"

    async def limit(self, prefix_len: int) -> LimitReport | None:
        cfg = self.config.limit
        if cfg is None or cfg.mode not in self.systems:
            return None
        options = RunOptions(warmup_requests=cfg.warmup_requests,
                             max_in_flight=self.config.budget.max_in_flight)
        builder = self._fixed(prefix_len)
        workload = builder.build(cfg.qps, cfg.warmup_requests + cfg.requests)
        self.progress.start_point(f"limit {cfg.mode} @ {cfg.qps:g} QPS", len(workload.requests))
        result = await run_point(self.systems[cfg.mode], workload, options, self.progress)
        self.progress.end_point()
        stats = point_stats(result, cfg.mode, "limit", cfg.qps, prefix_len)
        self.meter.add(stats)
        relayed = [r for r in result.records if r.path in RELAYED_PATHS]
        return limit_report(stats, self.probe, self.config.model, self.peak_gflops,
                            round(stats.prefix_tokens_mean), round(stats.suffix_tokens_mean),
                            round(stats.candidates_mean), latency_parts(relayed),
                            compute_by_path(relayed),
                            [1e3 * r.ranking_latency_s for r in relayed],
                            isolated_passes(cfg.requests))

    async def exactness(self, builder: WorkloadBuilder) -> ExactnessReport | None:
        cfg = self.config.exactness
        if cfg is None or not {cfg.reference, cfg.candidate} <= set(self.systems):
            return None
        workload = builder.build(cfg.qps, cfg.requests)
        return await replay_exactness(self.systems[cfg.reference], self.systems[cfg.candidate],
                                      workload, cfg.reference, cfg.candidate)

    async def run(self) -> BenchReport:
        started, t0 = dt.datetime.now(dt.timezone.utc), time.perf_counter()
        cfg = self.config
        if cfg.deadline_s is not None:
            self.meter.start_deadline(cfg.deadline_s)
        sweep = await self.sweep() if cfg.sweep else None
        self._finished("sweep", sweep)
        point = self.operating_point(sweep)
        self._finished("operating_point", point)
        throughput = search = None
        prefix_len, chosen_by = self.throughput_prefix_len(sweep, point)
        at_point = point if point is not None and point.prefix_len == prefix_len else None
        if at_point is not None:
            self.meter.batch_caps[("baseline", "throughput")] = at_point.baseline_batch
            if at_point.layout_curve \
                    and at_point.baseline_layout != at_point.layout_curve[0].layout:
                assert at_point.baseline_layout is not None
                self.meter.layouts[("baseline", "throughput")] = at_point.baseline_layout
        if cfg.throughput:
            search = self.throughput_search(cfg.throughput, at_point)
            throughput = await self.qps_search("throughput", self._fixed(prefix_len), search,
                                               prefix_len)
            self._finished("throughput", {"prefix_len": prefix_len, "chosen_by": chosen_by,
                                          "searches": throughput})
        mixed_builder = (workload_builder(cfg.mixed.source, cfg.mixed.params, cfg.seed)
                         if cfg.mixed else SyntheticWorkload(cfg.population, cfg.seed))
        mixed = (await self.qps_search("mixed", mixed_builder, cfg.mixed.search, None)
                 if cfg.mixed and cfg.mixed.search else None)
        self._finished("mixed", mixed)
        extra: dict[str, dict[str, object]] = {}
        for wp in cfg.workloads:
            builder = workload_builder(wp.source, wp.params, cfg.seed)
            found = await self.qps_search(wp.name, builder, wp.search, None, wp.modes)
            extra[wp.name] = {"source": wp.source, "workload": builder.describe(),
                              "slo_throughput_qps": {m: r.best_qps for m, r in found.items()},
                              "searches": found}
            self._finished(wp.name, extra[wp.name])
        limit = await self.limit(cfg.limit.prefix_len or prefix_len if cfg.limit else prefix_len)
        self._finished("limit", limit)
        exactness = await self.exactness(mixed_builder)
        self._finished("exactness", exactness)
        phases = Phases(point, prefix_len, chosen_by, sweep, throughput, mixed, extra, limit,
                        exactness, mixed_builder.describe() if cfg.mixed else None, search)
        return assemble(cfg, tuple(self.systems), tuple(self.points), self.meter.summaries, phases,
                        started, time.perf_counter() - t0)


def baseline_length_cap(sweep: dict[str, LengthSweepResult] | None) -> int | None:
    """The longest grid length the baseline's sweep did not fail at, above the longest it
    passed (its answer interval's upper end); None when it has no sweep, passed no length, or
    failed none above its answer."""
    found = (sweep or {}).get("baseline")
    if found is None or not found.max_seq_len or found.failing_above_len is None:
        return None
    return int(found.answer_interval[1])

