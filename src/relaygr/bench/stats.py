"""Statistics of one measured point: latency percentiles, paths, hits, trigger reasons, bytes.

Percentiles are nearest-rank (numpy ``inverted_cdf``): every reported P99 is a latency some
request actually saw. Requests that were dropped, failed or timed out count as infinite latency
(and as SLO overages). Whether a point met the SLO is not read off its P99 estimate but decided
from its overage count (``PointStats.decision``, ``relaygr.bench.decision``).

P99 confidence: a distribution-free 95% interval from order statistics (the number of samples
below the true quantile is Binomial(n, q)). With 2,000 samples it spans the 98.55th to 99.45th
sample percentiles; with 367 or fewer its upper end is beyond the largest sample (reported as
infinite).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from relaygr.bench.decision import P99Decision, Verdict
from relaygr.bench.protocol import DEVICE_SERVED_PATHS, RELAYED_PATHS, RequestRecord
from relaygr.bench.runner import RunResult
from relaygr.engine.types import RankPath

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}


def percentile(values: np.ndarray, q: float) -> float:
    """Nearest-rank ``q``-th percentile (0-100) of ``values``; NaN when empty."""
    if not len(values):
        return math.nan
    return float(np.percentile(values, q, method="inverted_cdf"))


def quantile_ci_ranks(n: int, q: float,
                      confidence: float = 0.95) -> tuple[int | None, int | None]:
    """1-based ranks (lo, hi) of order statistics bracketing the ``q`` quantile (0-1).

    ``lo`` is None when even the smallest sample is not a safe lower bound, ``hi`` when even
    the largest is not a safe upper one (too few samples: a median from five or fewer).
    """
    if n < 1:
        return None, None
    k = np.arange(n + 1)
    log_pmf = (math.lgamma(n + 1) - np.array([math.lgamma(i + 1) + math.lgamma(n - i + 1)
                                              for i in k])
               + k * math.log(q) + (n - k) * math.log1p(-q))
    cdf = np.cumsum(np.exp(log_pmf))  # cdf[j] = P(X <= j), X = samples below the quantile
    alpha = 1.0 - confidence
    below = np.flatnonzero(cdf <= alpha / 2)
    lo = int(below[-1]) + 1 if len(below) else None
    above = np.flatnonzero(cdf >= 1 - alpha / 2)
    hi = int(above[0]) + 1
    return lo, (hi if hi <= n else None)


@dataclass(frozen=True)
class LatencySummary:
    """Latency percentiles in ms over ``count`` samples, ``unserved`` of them infinite."""

    count: int
    unserved: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    mean_ms: float           # over served requests only
    max_ms: float
    p99_ci_low_ms: float
    p99_ci_high_ms: float    # inf when the sample is too small to bound P99 above

    @classmethod
    def of(cls, served_s: np.ndarray, unserved: int) -> LatencySummary:
        values_ms = np.concatenate([np.asarray(served_s, dtype=np.float64) * 1e3,
                                    np.full(unserved, np.inf)])
        n = len(values_ms)
        p = {name: percentile(values_ms, q) for name, q in PERCENTILES.items()}
        ordered = np.sort(values_ms)
        lo, hi = quantile_ci_ranks(n, 0.99)
        finite = values_ms[np.isfinite(values_ms)]
        return cls(count=n, unserved=unserved, p50_ms=p["p50"], p90_ms=p["p90"],
                   p99_ms=p["p99"], p999_ms=p["p999"],
                   mean_ms=float(finite.mean()) if len(finite) else math.nan,
                   max_ms=float(ordered[-1]) if n else math.nan,
                   p99_ci_low_ms=(math.nan if not n else 0.0 if lo is None
                                  else float(ordered[lo - 1])),
                   p99_ci_high_ms=float(ordered[hi - 1]) if hi is not None else math.inf)


@dataclass(frozen=True)
class PointStats:
    """Everything reported for one (mode, point): latency, paths, hits, trigger, memory.

    Hit rates and means are over completed requests. ``hit_rate_device`` counts requests served
    from device K/V computed ahead of ranking (``device_hit`` and ``pending_wait``);
    ``hit_rate_host`` counts ``host_hit``. Bytes are the peak and final values of the sampled
    system snapshots (0 when the system offers none).
    """

    mode: str
    phase: str
    qps: float
    prefix_len: int | None
    measured: int
    completed: int
    dropped: int
    failed: int
    timed_out: int
    not_sent: int
    stopped_early: bool
    ranking: LatencySummary
    e2e: LatencySummary
    # Ranking latency of the requests that took the relay path (ranked from a cached prefix).
    ranking_relayed: LatencySummary
    path_counts: dict[str, int]
    trigger_reasons: dict[str, int]
    errors: dict[str, int]
    hit_rate_device: float
    hit_rate_host: float
    preinfer_tokens_per_request: float
    prefix_tokens_mean: float
    suffix_tokens_mean: float
    candidates_mean: float
    device_bytes_peak: int
    host_bytes_peak: int
    device_bytes_end: int
    host_bytes_end: int
    counters_end: dict[str, float]
    dispatch_lag_p99_ms: float
    dispatch_lag_max_ms: float
    duration_s: float
    # The point's P99 verdict and its evidence (``relaygr.bench.decision``); None: no SLO.
    decision: P99Decision | None = None
    # The machine's noise during the point: the share of CPU time stolen by the hypervisor
    # (None: not measurable), a fixed calibration workload's time right after the point
    # (``hardware.calibration_ms``), and which attempt at this point it was (a point that did
    # not pass under noise is measured again).
    steal_fraction: float | None = None
    calibration_ms: float | None = None
    attempt: int = 1
    # 2 when a search measured this point again, afresh: the re-measure of the fail that decides
    # its answer (``relaygr.bench.search.Standing``).
    round: int = 1
    # Where the ranking latency went (``latency_parts``); empty when the system reports nothing.
    ranking_parts: dict[str, object] = field(default_factory=dict)
    # In flight when the point stopped on its decided fail: ended by the runner, latency unknown,
    # so in no latency figure (``RunResult.cancelled``).
    cancelled: int = 0

    @property
    def verdict(self) -> Verdict:
        """Whether the point met the SLO (undecided when it was judged without an SLO)."""
        return Verdict.UNDECIDED if self.decision is None else self.decision.verdict

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASS

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


LATENCY_PARTS = ("handoff", "lookup", "queue", "compute", "transport", "other")


def latency_parts(records: Sequence[RequestRecord]) -> dict[str, object]:
    """Ranking latency taken apart over the requests whose system reported its parts.

    Per part (``LATENCY_PARTS``; ``other`` is the latency beyond the reported parts): P50, P99
    and mean in ms over all those requests, and ``tail_mean_ms``, the mean over the slowest 1%
    of them by ranking latency (at least one): what the tail spent its time on.
    """
    timed = [(r.ranking_latency_s, r.parts) for r in records if r.parts is not None]
    if not timed:
        return {}
    latency = np.array([s for s, _ in timed]) * 1e3
    reported = np.array([(p.handoff_s, p.lookup_s, p.queue_s, p.compute_s, p.transport_s)
                         for _, p in timed]) * 1e3                       # [n, 5]
    columns = dict(zip(LATENCY_PARTS[:-1], reported.T, strict=True))   # all but other
    columns["other"] = np.maximum(latency - reported.sum(1), 0.0)
    tail = np.zeros(len(latency), dtype=bool)
    tail[np.argsort(latency, kind="stable")[-max(1, math.ceil(0.01 * len(latency))):]] = True
    parts = {name: {"p50_ms": percentile(v, 50.0), "p99_ms": percentile(v, 99.0),
                    "mean_ms": float(v.mean()), "tail_mean_ms": float(v[tail].mean())}
             for name, v in columns.items()}
    return {"requests": len(timed), "tail_requests": int(tail.sum()),
            "tail_latency_mean_ms": float(latency[tail].mean()), "parts": parts}


def compute_by_path(records: Sequence[RequestRecord]) -> dict[str, dict[str, float]]:
    """The model compute of the requests whose system reported its parts, per ranking path:
    ``requests``, ``p50_ms`` and ``mean_ms`` (a path whose compute exceeds the pass alone says
    where an overhead inside the instance comes from: a reloaded prefix, say, against one
    resident since its pre-inference)."""
    by_path: dict[str, list[float]] = {}
    for r in records:
        if r.parts is not None:
            by_path.setdefault(r.path, []).append(r.parts.compute_s * 1e3)
    return {path: {"requests": float(len(ms)), "p50_ms": percentile(np.array(ms), 50.0),
                   "mean_ms": float(np.mean(ms))} for path, ms in sorted(by_path.items())}


def point_stats(result: RunResult, mode: str, phase: str, qps: float,
                prefix_len: int | None = None) -> PointStats:
    """Summarise one run (see ``PointStats``)."""
    records = result.records
    unserved = result.unserved
    ranking_s = np.array([r.ranking_latency_s for r in records])
    e2e_s = np.array([r.e2e_done_s - result.send_s[r.request_id] for r in records])
    paths = Counter(r.path for r in records)
    reasons = Counter(r.trigger_reason or "none" for r in records)
    done = max(len(records), 1)
    device_served = sum(paths[p] for p in DEVICE_SERVED_PATHS)
    lags_ms = np.array(result.dispatch_lag_s) * 1e3
    snaps = result.snapshots
    return PointStats(
        mode=mode, phase=phase, qps=qps, prefix_len=prefix_len, measured=result.measured,
        completed=result.completed, dropped=result.dropped, failed=result.failed,
        timed_out=result.timed_out, not_sent=result.not_sent, cancelled=result.cancelled,
        stopped_early=result.stopped_early, decision=result.decision,
        ranking=LatencySummary.of(ranking_s, unserved), e2e=LatencySummary.of(e2e_s, unserved),
        ranking_relayed=LatencySummary.of(
            np.array([r.ranking_latency_s for r in records if r.path in RELAYED_PATHS]),
            0),
        path_counts=dict(sorted(paths.items())), trigger_reasons=dict(sorted(reasons.items())),
        errors=dict(result.errors),
        hit_rate_device=device_served / done, hit_rate_host=paths[RankPath.HOST_HIT.value] / done,
        preinfer_tokens_per_request=sum(r.preinfer_tokens for r in records) / done,
        prefix_tokens_mean=sum(r.prefix_tokens for r in records) / done,
        suffix_tokens_mean=sum(r.suffix_tokens for r in records) / done,
        candidates_mean=sum(r.candidates for r in records) / done,
        device_bytes_peak=max((s.device_bytes_in_use for s in snaps), default=0),
        host_bytes_peak=max((s.host_bytes_in_use for s in snaps), default=0),
        device_bytes_end=snaps[-1].device_bytes_in_use if snaps else 0,
        host_bytes_end=snaps[-1].host_bytes_in_use if snaps else 0,
        counters_end=dict(snaps[-1].counters) if snaps else {},
        dispatch_lag_p99_ms=percentile(lags_ms, 99.0) if len(lags_ms) else 0.0,
        dispatch_lag_max_ms=float(lags_ms.max()) if len(lags_ms) else 0.0,
        duration_s=result.duration_s, ranking_parts=latency_parts(records))
