"""Measured statistics of a built workload: what the report prints and the tests check."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from relaygr.bench.workload.base import Workload


@dataclass(frozen=True)
class Spread:
    """Moments and order statistics of one quantity."""

    mean: float
    std: float
    min: float
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: np.ndarray) -> Spread:
        if not len(values):
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        v = np.asarray(values, dtype=np.float64)
        return cls(float(v.mean()), float(v.std()), float(v.min()),
                   float(np.percentile(v, 50)), float(np.percentile(v, 99)), float(v.max()))


@dataclass(frozen=True)
class WorkloadSummary:
    """What a workload looks like as built (prefixes assume each visit's events are appended
    before the user's next visit)."""

    name: str
    qps: float
    requests: int
    users: int
    duration_s: float
    visits_per_user: Spread
    prefix_tokens: Spread        # at visit time
    history_at_query: Spread     # prefix + the visit's recent events
    suffix_tokens: Spread
    candidates: Spread
    timed_share: float
    revisit_gap_s: Spread        # gaps between consecutive visits of one user
    revisits_within_60s_share: float  # of all requests

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(workload: Workload) -> WorkloadSummary:
    requests = workload.requests
    prefix = workload.prefix_tokens_at_visit()
    suffix = np.array([len(r.recent_items) for r in requests], dtype=np.int64)
    last_send: dict[int, float] = {}
    gaps = []
    visits: dict[int, int] = {}
    for r in requests:
        if r.user_id in last_send:
            gaps.append(r.send_s - last_send[r.user_id])
        last_send[r.user_id] = r.send_s
        visits[r.user_id] = visits.get(r.user_id, 0) + 1
    gap_arr = np.array(gaps, dtype=np.float64)
    return WorkloadSummary(
        name=workload.name, qps=workload.qps, requests=len(requests), users=len(visits),
        duration_s=requests[-1].send_s if requests else 0.0,
        visits_per_user=Spread.of(np.array(list(visits.values()))),
        prefix_tokens=Spread.of(prefix), history_at_query=Spread.of(prefix + suffix),
        suffix_tokens=Spread.of(suffix),
        candidates=Spread.of(np.array([r.num_candidates for r in requests])),
        timed_share=float(np.mean([r.request_ts is not None for r in requests])),
        revisit_gap_s=Spread.of(gap_arr),
        revisits_within_60s_share=float((gap_arr < 60).sum() / max(len(requests), 1)))
