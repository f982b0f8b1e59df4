"""The benchmark's results: typed report, JSON file, rich console table.

JSON layout (every key always present; a figure that was not measured or is undefined, such as a
ratio over a zero baseline or an infinite P99, is ``null``)::

  {"slo_ms", "device", "model", "workload",
   "modes": {"<mode>": {"max_seq_len_under_slo", "slo_throughput_qps",
                        "slo_throughput_qps_mixed", "p99_ms": {"ranking", "e2e"},
                        "latency_ms": {"ranking": {p50,p90,p99,p999}, "e2e": {...}},
                        "hit_rate_device", "hit_rate_host", "path_counts", "trigger_reasons",
                        "preinfer_tokens_per_request", "device_bytes_in_use_peak",
                        "host_bytes_in_use_peak", "reference_point", "ranking_parts",
                        "sweep", "throughput_search", "mixed_search"}},
   "slo_throughput_qps_mixed": {"<mode>": qps},
   "ratios": {"relay_vs_baseline_seq_len", "relay_vs_baseline_throughput",
              "relay_vs_reactive_throughput", "relay_vs_baseline_throughput_mixed"},
   "limit": {"cached_rank_ms_isolated", "relay_overhead_ratio", "matmul_peak_gflops", ...},
   "exactness": {"requests_compared", "max_abs_score_diff", ...},
   "checks": {...the issue's bar, true/false/null...},
   "verdicts": [{"name", "value", "low", "high", "target", "status"}, ...],
   "workloads": {"<name>": {"source", "workload", "slo_throughput_qps": {"<system>": qps},
                            "searches"}},
   "points": [...every point...], "meta"}

A mode's latency, hit and byte figures come from its *reference point*: its highest passing QPS
in the fixed-length throughput search, else in the mixed search, else its longest passing sweep
length, else its first measured point (``reference_point`` says which).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from relaygr.bench.exactness import ExactnessReport
from relaygr.bench.qps_search import QpsSearchResult
from relaygr.bench.search import LengthSweepResult
from relaygr.bench.stats import LATENCY_PARTS, PointStats

# A point whose dispatch lag P99 exceeds this share of the SLO is flagged on the console.
LATE_DISPATCH_SHARE = 0.1


@dataclass(frozen=True)
class LimitReport:
    """The physical limit: isolated cached ranking vs the mode at low load, and FLOP/s."""

    mode: str
    qps: float
    prefix_len: int
    suffix_tokens: int
    candidates: int
    cached_rank_ms_isolated: float | None
    low_load_p50_ms: float                # over the low-load requests that took the relay path
    low_load_p99_ms: float                # over all of the point's requests
    low_load_relayed_share: float
    relay_overhead_ratio: float | None    # low-load P50 / isolated cached ranking
    matmul_peak_gflops: float | None
    achieved_gflops: float | None         # cached-ranking FLOPs / isolated latency
    achieved_fraction_of_peak: float | None


@dataclass(frozen=True)
class TargetVerdict:
    """One target of the bar: the figure, the interval it is known within (``high`` inf:
    unbounded; both None: not measured) and ``status``: met, missed, undecided or not
    measured (``relaygr.bench.verdict``)."""

    name: str
    value: float | None
    low: float | None
    high: float | None
    target: float
    status: str


@dataclass(frozen=True)
class ModeReport:
    """One mode's headline figures, its reference point and its search traces."""

    mode: str
    max_seq_len_under_slo: int | None
    slo_throughput_qps: float | None
    slo_throughput_qps_mixed: float | None
    reference: PointStats | None
    sweep: LengthSweepResult | None
    throughput: QpsSearchResult | None
    mixed: QpsSearchResult | None


@dataclass(frozen=True)
class BenchReport:
    """Everything one ``run_benchmark`` measured (see the module docstring for the JSON)."""

    slo_ms: float
    device: str
    model: dict[str, Any]
    workload: dict[str, Any]
    modes: dict[str, ModeReport]
    ratios: dict[str, float | None]
    limit: LimitReport | None
    exactness: ExactnessReport | None
    checks: dict[str, bool | None]
    points: tuple[PointStats, ...]
    meta: dict[str, Any]
    # Extra workload phases: name -> {"source", "workload", "slo_throughput_qps": {system: qps},
    # "searches": {system: QpsSearchResult}}.
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)
    verdicts: tuple[TargetVerdict, ...] = ()

    def to_json_dict(self) -> dict[str, Any]:
        out = {"slo_ms": self.slo_ms, "device": self.device, "model": self.model,
               "workload": self.workload,
               "modes": {m: _mode_json(r) for m, r in self.modes.items()},
               "slo_throughput_qps_mixed": {m: r.slo_throughput_qps_mixed
                                            for m, r in self.modes.items()},
               "ratios": self.ratios, "limit": _limit_json(self.limit),
               "exactness": _exactness_json(self.exactness), "checks": self.checks,
               "verdicts": [asdict(v) for v in self.verdicts],
               "workloads": self.workloads,
               "points": [p.to_dict() for p in self.points], "meta": self.meta}
        return jsonable(out)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def _mode_json(r: ModeReport) -> dict[str, Any]:
    ref = r.reference
    lat = {name: None if ref is None else {k: getattr(getattr(ref, name), f"{k}_ms")
                                             for k in ("p50", "p90", "p99", "p999")}
           for name in ("ranking", "e2e")}
    return {
        "max_seq_len_under_slo": r.max_seq_len_under_slo,
        "slo_throughput_qps": r.slo_throughput_qps,
        "slo_throughput_qps_mixed": r.slo_throughput_qps_mixed,
        "p99_ms": {"ranking": None if ref is None else ref.ranking.p99_ms,
                   "e2e": None if ref is None else ref.e2e.p99_ms},
        "latency_ms": lat,
        "hit_rate_device": None if ref is None else ref.hit_rate_device,
        "hit_rate_host": None if ref is None else ref.hit_rate_host,
        "path_counts": None if ref is None else ref.path_counts,
        "trigger_reasons": None if ref is None else ref.trigger_reasons,
        "preinfer_tokens_per_request": None if ref is None else ref.preinfer_tokens_per_request,
        "device_bytes_in_use_peak": None if ref is None else ref.device_bytes_peak,
        "host_bytes_in_use_peak": None if ref is None else ref.host_bytes_peak,
        "reference_point": None if ref is None else {
            "phase": ref.phase, "qps": ref.qps, "prefix_len": ref.prefix_len},
        # where the reference point's ranking latency went (stats.latency_parts)
        "ranking_parts": None if ref is None else ref.ranking_parts or None,
        "sweep": None if r.sweep is None else asdict(r.sweep),
        "throughput_search": None if r.throughput is None else asdict(r.throughput),
        "mixed_search": None if r.mixed is None else asdict(r.mixed),
    }


_LIMIT_KEYS = ("cached_rank_ms_isolated", "relay_overhead_ratio", "matmul_peak_gflops")


def _limit_json(limit: LimitReport | None) -> dict[str, Any]:
    return dict.fromkeys(_LIMIT_KEYS) if limit is None else asdict(limit)


def _exactness_json(exactness: ExactnessReport | None) -> dict[str, Any]:
    if exactness is None:
        return {"requests_compared": 0, "max_abs_score_diff": None}
    return asdict(exactness)


def jsonable(value: Any) -> Any:
    """Plain JSON values: dataclasses and mappings to dicts, tuples to lists, inf/nan to None."""
    if is_dataclass(value) and not isinstance(value, type):
        return jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy scalars
        return jsonable(value.item())
    return str(value)


def write_json(report: BenchReport, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json_dict(), indent=2, allow_nan=False) + "\n")
    return path


def _fmt(value: float | int | None, spec: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _print_parts(report: BenchReport, console: Console) -> None:
    """Where each mode's ranking time went at its reference point: median, and the slowest 1%."""
    rows = [(mode, r.reference.ranking_parts) for mode, r in report.modes.items()
            if r.reference is not None and r.reference.ranking_parts]
    if not rows:
        return
    table = Table(title="ranking latency taken apart at each mode's reference point: "
                        "P50 / mean of the slowest 1% (ms)")
    table.add_column("mode", no_wrap=True)
    for part in LATENCY_PARTS:
        table.add_column(part, justify="right")
    for mode, parts in rows:
        by_part = parts["parts"]
        assert isinstance(by_part, dict)
        table.add_row(mode, *(f"{by_part[p]['p50_ms']:.1f} / {by_part[p]['tail_mean_ms']:.1f}"
                              for p in LATENCY_PARTS))
    console.print(table)


def print_report(report: BenchReport, console: Console | None = None) -> None:
    """The headline table per mode, then ratios, the physical limit and exactness."""
    console = console or Console()
    table = Table(title=f"ranking P99 SLO {report.slo_ms:g} ms on {report.device}")
    table.add_column("mode", no_wrap=True)
    for column in ("max len", "QPS@len", "QPS mix", "P50 ms", "P99 ms", "e2e P99", "dev hit",
                   "host hit"):
        table.add_column(column, justify="right")
    for mode, r in report.modes.items():
        ref = r.reference
        table.add_row(
            mode, _fmt(r.max_seq_len_under_slo, "d"), _fmt(r.slo_throughput_qps),
            _fmt(r.slo_throughput_qps_mixed),
            _fmt(None if ref is None else ref.ranking.p50_ms),
            _fmt(None if ref is None else ref.ranking.p99_ms),
            _fmt(None if ref is None else ref.e2e.p99_ms),
            _fmt(None if ref is None else ref.hit_rate_device, ".0%"),
            _fmt(None if ref is None else ref.hit_rate_host, ".0%"))
    console.print(table)
    _print_parts(report, console)
    console.print("ratios: " + ", ".join(f"{k} {_fmt(v, '.2f')}x"
                                         for k, v in report.ratios.items()))
    for name, phase in report.workloads.items():
        qps = phase["slo_throughput_qps"]
        console.print(f"workload {name} ({phase['source']}): SLO throughput " + ", ".join(
            f"{system} {_fmt(value)} QPS" for system, value in qps.items()))
    if report.limit is not None:
        lim = report.limit
        console.print(f"limit: isolated cached ranking {_fmt(lim.cached_rank_ms_isolated, '.2f')}"
                      f" ms, {lim.mode} at {lim.qps:g} QPS P50 {lim.low_load_p50_ms:.2f} ms "
                      f"(overhead {_fmt(lim.relay_overhead_ratio, '.2f')}x), matmul peak "
                      f"{_fmt(lim.matmul_peak_gflops)} GFLOP/s, achieved "
                      f"{_fmt(lim.achieved_gflops)} GFLOP/s")
    if report.exactness is not None:
        ex = report.exactness
        console.print(f"exactness: {ex.requests_compared} requests, max |score diff| "
                      f"{ex.max_abs_score_diff:.2e} ({ex.candidate_mode} vs {ex.reference_mode})")
    late = [p for p in report.points
            if p.dispatch_lag_p99_ms > LATE_DISPATCH_SHARE * report.slo_ms]
    if late:
        worst = max(p.dispatch_lag_max_ms for p in late)
        console.print(f"[yellow]warning: the dispatcher sent late in {len(late)} points (worst "
                      f"{worst:.1f} ms): something blocked the event loop; those requests were "
                      f"charged from their scheduled time[/yellow]")
    _print_verdicts(report, console)


def _print_verdicts(report: BenchReport, console: Console) -> None:
    """The bar, target by target: the figure, the interval it is known within, the status."""
    table = Table(title="verdict: each target met only when its whole interval meets it")
    for column in ("target", "figure", "known within", "status"):
        table.add_column(column, justify="left" if column == "target" else "right")
    colour = {"met": "green", "missed": "red", "undecided": "yellow"}
    for v in report.verdicts:
        spec = ".2e" if v.target < 1e-2 else ".2f"
        within = "-" if v.low is None else f"[{_fmt(v.low, spec)}, " + (
            "inf" if v.high is None or not math.isfinite(v.high) else _fmt(v.high, spec)) + "]"
        style = colour.get(v.status, "dim")
        table.add_row(f"{v.name} ({_fmt(v.target, spec)})", _fmt(v.value, spec), within,
                      f"[{style}]{v.status}[/{style}]")
    console.print(table)
