"""The benchmark's results on the console: the headline table per mode, the operating point,
the ranking latency taken apart, ratios, the physical limit and its overhead taken apart,
exactness, and last the verdict table (``relaygr.bench.report`` holds the data)."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from relaygr.bench.limit import describe_overhead
from relaygr.bench.operating import OperatingPoint
from relaygr.bench.report import BenchReport, LimitReport
from relaygr.bench.stats import LATENCY_PARTS

# A point whose dispatch lag P99 exceeds this share of the SLO is flagged on the console.
LATE_DISPATCH_SHARE = 0.1


def _within(lim: LimitReport) -> str:
    """The overhead's interval as printed beside it (empty when there is none)."""
    if lim.relay_overhead_low is None or lim.relay_overhead_high is None:
        return ""
    return (f", within [{lim.relay_overhead_low:.2f}, {lim.relay_overhead_high:.2f}]: "
            f"{lim.ranking_parts.get('requests', '?')} relayed requests, "
            f"{lim.isolated_passes} passes alone")


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
    if report.operating_point is not None:
        console.print(operating_table(report.operating_point))
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
                      f"(overhead {_fmt(lim.relay_overhead_ratio, '.2f')}x{_within(lim)}), "
                      f"matmul peak "
                      f"{_fmt(lim.matmul_peak_gflops)} GFLOP/s, achieved "
                      f"{_fmt(lim.achieved_gflops)} GFLOP/s")
        overhead = describe_overhead(lim)
        if overhead is not None:
            console.print(overhead)
    if report.exactness is not None:
        ex = report.exactness
        console.print(f"exactness: {ex.requests_compared} requests, max |score diff| "
                      f"{ex.max_abs_score_diff:.2e} ({ex.candidate_mode} vs {ex.reference_mode})"
                      + (f"; not compared: {ex.requests_skipped} of other inputs in the two "
                         f"runs, {ex.requests_unanswered} unanswered in one"
                         if ex.requests_skipped or ex.requests_unanswered else ""))
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


def operating_table(point: OperatingPoint) -> Table:
    """The console's account of the operating point: the measured curve and the choice."""
    serving = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in point.serving.items())
    where = ("in its instances, all computing at once" if point.layout_curve
             else "as the probe timed it")
    why = (f"the baseline's length cap, short of where the {point.statistic} of its full pass "
           f"takes {point.slo_share:.0%} of the SLO {where}" if point.bound == "capped" else
           f"where the {point.statistic} of the baseline's full pass takes "
           f"{point.slo_share:.0%} of the SLO {where}")
    table = Table(title=f"fixed-length operating point: {point.prefix_len} tokens, {why}"
                        + (f" (every mode serves on {serving}; the baseline's batch cap "
                           "and layout in its throughput search are marked below)"
                           if serving else ""))
    if point.calibration_ms is not None:
        steal = "n/a" if point.steal_fraction is None else f"{point.steal_fraction:.0%}"
        table.caption = (f"measured at {steal} steal, calibration {point.calibration_ms:.2f} "
                         "ms")
    for column in ("prefix tokens", f"full pass ms ({point.statistic}; batches: median)",
                   "share of SLO", ""):
        table.add_column(column, justify="right")
    for sample in sorted(point.curve, key=lambda s: s.prefix_tokens):
        chosen = "chosen" if sample.prefix_tokens == point.prefix_len else ""
        table.add_row(str(sample.prefix_tokens), f"{sample.cost_ms:.1f}",
                      f"{sample.cost_ms / point.slo_ms:.0%}", chosen)
    for b in point.batch_curve:
        chosen = "baseline's batch cap" if b.batch == point.baseline_batch else ""
        users = "user" if b.batch == 1 else "users"
        table.add_row(f"{point.prefix_len} x {b.batch} {users}", f"{b.cost_ms:.1f}",
                      f"{b.cost_ms / point.slo_ms:.0%}", chosen)
    for layout in point.layout_curve:
        chosen = "baseline's layout" if layout.layout == point.baseline_layout else ""
        table.add_row(f"{point.prefix_len} on {layout.layout}", f"{layout.cost_ms:.1f}",
                      f"{layout.cost_ms / point.slo_ms:.0%}",
                      f"{layout.requests_per_s:.0f} req/s {chosen}".strip())
    return table
