"""Headline figures derived from the measured points: reference points, ratios, the bar.

The bar (issue 5, on one machine in one full run): relay vs baseline >= 2x max sequence length
and >= 4x SLO-compliant throughput; relay ahead of ``reactive`` and not behind any ablation
(``relay-*`` modes) on throughput; relay's low-load overhead within 1.15x of the isolated cached
ranking latency; exactness within 1e-4. A check whose inputs were not measured is None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from relaygr.bench.exactness import ExactnessReport
from relaygr.bench.report import LimitReport, ModeReport, ratio
from relaygr.bench.stats import PointStats

SEQ_LEN_TARGET, THROUGHPUT_TARGET = 2.0, 4.0
OVERHEAD_TARGET, EXACTNESS_TARGET = 1.15, 1e-4


def reference_point(mode: str, points: Sequence[PointStats], slo_ms: float) -> PointStats | None:
    """The point a mode's headline latency/hit/byte figures come from (see ``report``)."""
    mine = [p for p in points if p.mode == mode]
    for phase in ("throughput", "mixed"):
        passing = [p for p in mine if p.phase == phase and p.meets_slo(slo_ms)]
        if passing:
            return max(passing, key=lambda p: p.qps)
    standing = {p.prefix_len: p for p in mine if p.phase == "sweep"}   # the last round of each
    swept = [p for p in standing.values() if p.meets_slo(slo_ms)]
    if swept:
        return max(swept, key=lambda p: p.prefix_len or 0)
    return mine[0] if mine else None


def _figure(modes: Mapping[str, ModeReport], mode: str, attr: str) -> float | None:
    value = getattr(modes[mode], attr) if mode in modes else None
    return None if value is None else float(value)


def compute_ratios(modes: Mapping[str, ModeReport]) -> dict[str, float | None]:
    """relay over baseline / reactive for the headline figures (None when undefined)."""
    def r(attr: str, other: str) -> float | None:
        return ratio(_figure(modes, "relay", attr), _figure(modes, other, attr))

    return {"relay_vs_baseline_seq_len": r("max_seq_len_under_slo", "baseline"),
            "relay_vs_baseline_throughput": r("slo_throughput_qps", "baseline"),
            "relay_vs_reactive_throughput": r("slo_throughput_qps", "reactive"),
            "relay_vs_baseline_throughput_mixed": r("slo_throughput_qps_mixed", "baseline")}


def _at_least(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


def compute_checks(modes: Mapping[str, ModeReport], ratios: Mapping[str, float | None],
                   limit: LimitReport | None,
                   exactness: ExactnessReport | None) -> dict[str, bool | None]:
    relay_qps = _figure(modes, "relay", "slo_throughput_qps")
    ablations = [_figure(modes, m, "slo_throughput_qps") for m in modes if m.startswith("relay-")]
    measured_ablations = [a for a in ablations if a is not None]
    overhead = None if limit is None else limit.relay_overhead_ratio
    exact = (None if exactness is None or not exactness.requests_compared
             else exactness.max_abs_score_diff <= EXACTNESS_TARGET)
    reactive = ratios.get("relay_vs_reactive_throughput")
    return {
        "relay_vs_baseline_seq_len_ge_2x": _at_least(ratios.get("relay_vs_baseline_seq_len"),
                                                     SEQ_LEN_TARGET),
        "relay_vs_baseline_throughput_ge_4x": _at_least(
            ratios.get("relay_vs_baseline_throughput"), THROUGHPUT_TARGET),
        "relay_ahead_of_reactive": None if reactive is None else reactive > 1.0,
        "relay_not_behind_ablations": (None if relay_qps is None or not measured_ablations
                                       else all(relay_qps >= a for a in measured_ablations)),
        "relay_overhead_within_1_15x": None if overhead is None else overhead <= OVERHEAD_TARGET,
        "exactness_within_1e-4": exact,
    }
