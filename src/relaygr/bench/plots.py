"""PNG plots of a report (matplotlib's object API: no pyplot state, no display needed).

- ``p99_vs_prefix_len.png``: ranking P99 over the length sweep, one line per mode, SLO dashed.
- ``p99_vs_qps.png``: ranking P99 over the QPS-search trials (fixed length; mixed workload).
- ``hit_rates.png``: device and host hit rates per mode at each mode's reference point.
Infinite P99s (unserved requests) are drawn at the top of the axis with an ``x``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from relaygr.bench.report import BenchReport


def _draw_trials(ax: Axes, label: str, trials: Iterable[tuple[float, float]],
                 ceiling: float) -> None:
    """One line of (x, P99 ms) pairs; P99s above ``ceiling`` (or infinite) drawn as x at it."""
    ordered = sorted(trials)
    if not ordered:
        return
    xs = [x for x, _ in ordered]
    ys = [min(p99, ceiling) for _, p99 in ordered]
    (line,) = ax.plot(xs, ys, marker="o", label=label)
    clipped = [(x, ceiling) for x, p99 in ordered if not math.isfinite(p99) or p99 > ceiling]
    if clipped:
        ax.scatter([x for x, _ in clipped], [y for _, y in clipped], marker="x", s=60,
                   color=line.get_color())


def _finish(ax: Axes, slo_ms: float, ceiling: float, xlabel: str) -> None:
    ax.axhline(slo_ms, linestyle="--", color="black", linewidth=1, label=f"SLO {slo_ms:g} ms")
    ax.set_ylim(0, ceiling * 1.05)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ranking P99 (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_p99_vs_prefix_len(report: BenchReport, path: Path) -> Path:
    ceiling = 3 * report.slo_ms
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for mode, r in report.modes.items():
        if r.sweep is not None:
            _draw_trials(ax, mode, [(t.point, t.p99_ms) for t in r.sweep.latest()],
                         ceiling)
    ax.set_xscale("log", base=2)
    _finish(ax, report.slo_ms, ceiling, "prefix length (tokens)")
    ax.set_title("Ranking P99 vs prefix length")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_p99_vs_qps(report: BenchReport, path: Path) -> Path:
    ceiling = 3 * report.slo_ms
    fig = Figure(figsize=(12, 4.5))
    axes = fig.subplots(1, 2)
    titles = ("fixed prefix length", "mixed workload")
    for ax, title, attr in zip(axes, titles, ("throughput", "mixed"), strict=True):
        for mode, r in report.modes.items():
            search = getattr(r, attr)
            if search is not None:
                _draw_trials(ax, mode, [(t.point, t.p99_ms) for t in search.trials], ceiling)
        _finish(ax, report.slo_ms, ceiling, "offered load (QPS, Poisson)")
        ax.set_title(f"Ranking P99 vs QPS: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_hit_rates(report: BenchReport, path: Path) -> Path:
    modes = list(report.modes)
    device = [r.reference.hit_rate_device if r.reference else 0.0 for r in report.modes.values()]
    host = [r.reference.hit_rate_host if r.reference else 0.0 for r in report.modes.values()]
    fig = Figure(figsize=(max(6, 1.3 * len(modes)), 4))
    ax = fig.subplots()
    xs = range(len(modes))
    ax.bar([x - 0.2 for x in xs], device, width=0.4, label="device")
    ax.bar([x + 0.2 for x in xs], host, width=0.4, label="host")
    ax.set_xticks(list(xs), modes, rotation=20, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of requests")
    ax.set_title("Prefix K/V hit rates at each mode's reference point")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def write_plots(report: BenchReport, out_dir: Path) -> list[Path]:
    """All three plots into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot_p99_vs_prefix_len(report, out_dir / "p99_vs_prefix_len.png"),
            plot_p99_vs_qps(report, out_dir / "p99_vs_qps.png"),
            plot_hit_rates(report, out_dir / "hit_rates.png")]
