"""The benchmark's results: the typed report and its JSON file (``console`` prints it).

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

from relaygr.bench.exactness import ExactnessReport
from relaygr.bench.operating import OperatingPoint
from relaygr.bench.qps_search import QpsSearchResult
from relaygr.bench.search import LengthSweepResult
from relaygr.bench.stats import PointStats


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
    # The low-load latency taken apart over the same relayed requests (``stats.latency_parts``:
    # lookup, queue, compute, transport, other) and the point's paths: what the overhead is.
    ranking_parts: dict[str, object] = field(default_factory=dict)
    path_counts: dict[str, int] = field(default_factory=dict)
    reload_copies: float = 0.0            # host -> device reloads during the point
    # The model compute of those requests per ranking path (``stats.compute_by_path``).
    compute_by_path: dict[str, dict[str, float]] = field(default_factory=dict)
    # The ratio's interval (``bench.limit``: both medians' 95% order-statistic intervals; None:
    # not computed) and the isolated passes timed.
    relay_overhead_low: float | None = None
    relay_overhead_high: float | None = None
    isolated_passes: int = 0


@dataclass(frozen=True)
class TargetVerdict:
    """One target of the bar: the figure, the interval it is known within (``high`` inf:
    unbounded; both None: not measured, or an estimate with no interval, undecided) and
    ``status``: met, missed, undecided or not measured (``relaygr.bench.verdict``)."""

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
    # Where the fixed-length throughput search ran and why (in ``workload.throughput`` too).
    operating_point: OperatingPoint | None = None

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
