"""The report of a finished run: each mode's headline figures, the ratios, the verdicts, and
what the workloads and the plan were, from the phases' results (``suite.BenchSuite.run``)."""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from relaygr.bench.config import BenchConfig, QpsSearchConfig
from relaygr.bench.exactness import ExactnessReport
from relaygr.bench.hardware import describe_device
from relaygr.bench.operating import OperatingPoint
from relaygr.bench.qps_search import QpsSearchResult
from relaygr.bench.report import BenchReport, LimitReport, ModeReport
from relaygr.bench.search import LengthSweepResult
from relaygr.bench.stats import PointStats
from relaygr.bench.verdict import (
    compute_checks,
    compute_ratios,
    compute_verdicts,
    reference_point,
)


@dataclass(frozen=True)
class Phases:
    """What each phase of a run found (None: the phase was not run)."""

    operating_point: OperatingPoint | None
    prefix_len: int                 # the fixed-length throughput search's length
    chosen_by: str                  # and why
    sweep: dict[str, LengthSweepResult] | None
    throughput: dict[str, QpsSearchResult] | None
    mixed: dict[str, QpsSearchResult] | None
    workloads: dict[str, dict[str, object]]
    limit: LimitReport | None
    exactness: ExactnessReport | None
    mixed_workload: dict[str, object] | None
    # the throughput searches' configuration as run (their start near the baseline's capacity)
    throughput_search: QpsSearchConfig | None = None


def mode_report(mode: str, points: Sequence[PointStats], slo_ms: float,
                phases: Phases) -> ModeReport:
    """``mode``'s answers to each search and its reference point."""
    s = phases.sweep.get(mode) if phases.sweep else None    # a mode may not be swept
    t = phases.throughput[mode] if phases.throughput else None
    x = phases.mixed[mode] if phases.mixed else None
    return ModeReport(
        mode=mode, max_seq_len_under_slo=None if s is None else s.max_seq_len,
        slo_throughput_qps=None if t is None else t.best_qps,
        slo_throughput_qps_mixed=None if x is None else x.best_qps,
        reference=reference_point(mode, points, slo_ms), sweep=s, throughput=t, mixed=x)


def assemble(config: BenchConfig, modes: Sequence[str], points: Sequence[PointStats],
             summaries: Mapping[str, dict[str, object]], phases: Phases,
             started: dt.datetime, duration_s: float) -> BenchReport:
    """The ``BenchReport`` of a run (``report``'s docstring has its JSON)."""
    reports = {m: mode_report(m, points, config.slo_ms, phases) for m in modes}
    ratios = compute_ratios(reports)
    verdicts = compute_verdicts(reports, ratios, phases.limit, phases.exactness)
    point = phases.operating_point
    workload: dict[str, Any] = {
        "population": config.population.describe(),
        # budget_s: seconds of measuring each mode's sweep may spend (null: unbounded);
        # rel_tol: how narrow its bracket is made past the grid (null: not at all)
        "sweep": None if config.sweep is None else {
            "qps": config.sweep.qps, "lengths": config.sweep.lengths,
            "budget_s": config.sweep.budget_s, "rel_tol": config.sweep.rel_tol,
            "quantum_tokens": config.sweep.quantum_tokens,
            "modes": config.sweep.swept(modes)},
        "throughput": {"prefix_len": phases.prefix_len, "chosen_by": phases.chosen_by,
                       "search": None if phases.throughput_search is None
                       else asdict(phases.throughput_search),
                       "start_capacity_share": None if config.throughput is None
                       else config.throughput.start_capacity_share,
                       "operating_point": None if point is None else {
                           **asdict(point), "reason": point.reason,
                           "baseline_requests_per_s": point.baseline_requests_per_s}},
        "mixed": phases.mixed_workload, "summaries": dict(summaries)}
    return BenchReport(
        slo_ms=config.slo_ms, device=describe_device(config.device),
        model={} if config.model is None else config.model.to_dict(), workload=workload,
        modes=reports, ratios=ratios, limit=phases.limit, exactness=phases.exactness,
        checks=compute_checks(verdicts), verdicts=verdicts, points=tuple(points),
        workloads=phases.workloads, operating_point=point,
        meta={"seed": config.seed, "started_at": started.isoformat(),
              "duration_s": duration_s, "modes": list(modes), "budget": config.budget,
              "deadline_s": config.deadline_s,
              "cpu_count": os.cpu_count(), "instance_placement": config.instance_placement,
              "serving": dict(config.serving), "load_average_end": list(os.getloadavg()),
              "platform": platform.platform(), "python": platform.python_version()})
