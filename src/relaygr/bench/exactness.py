"""Exactness: the same requests through two modes must give the same scores.

Both modes get a fresh system over the same workload and keep their scores; every request both
answered with scores is compared candidate by candidate. Relay-race inference is exact by
construction (DESIGN.md section 3), so the maximum difference is float rounding. The comparison
assumes both systems score the same candidates, in the same order, for a request (retrieval and
pre-processing deterministic given the store and the model).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from relaygr.bench.protocol import RequestRecord, SystemFactory
from relaygr.bench.runner import RunOptions, run_point
from relaygr.bench.workload import Workload
from relaygr.errors import BenchProtocolError


@dataclass(frozen=True)
class ExactnessReport:
    """Score agreement of ``candidate_mode`` with ``reference_mode`` on the same requests.

    ``candidate_paths`` shows which paths the compared requests took in the candidate mode
    (a comparison is only meaningful when cache paths were exercised).
    """

    reference_mode: str
    candidate_mode: str
    requests_compared: int
    scores_compared: int
    max_abs_score_diff: float
    candidate_paths: dict[str, int]
    # requests answered by both whose inputs differ between the runs: an earlier request of the
    # same user was answered in one run only, so its events are in one history and not the
    # other; or its earlier visit's events were appended before it arrived in one run (ranked
    # sooner) and after in the other, so the two ranked prefixes differ in length
    requests_skipped: int = 0
    # requests of either run without scores in the other (failed, timed out, dropped): not
    # compared, and not evidence of agreement
    requests_unanswered: int = 0


def _diverged(reference: tuple[RequestRecord, ...], candidate: tuple[RequestRecord, ...]
              ) -> dict[int, int]:
    """Per user, the first request id answered in one run and not the other (a user's events
    are appended after each answered request, so from there on the two histories differ)."""
    answered: dict[int, list[set[int]]] = {}
    for side, records in enumerate((reference, candidate)):
        for r in records:
            answered.setdefault(r.user_id, [set(), set()])[side].add(r.request_id)
    return {user: min(a ^ b) for user, (a, b) in answered.items() if a ^ b}


def compare_records(reference: tuple[RequestRecord, ...], candidate: tuple[RequestRecord, ...],
                    reference_mode: str, candidate_mode: str) -> ExactnessReport:
    """Compare scores of requests present with scores in both; lengths must agree. A request
    after one of its user's that only one run answered, or whose ranked prefix differs in
    length between the runs, is skipped and counted (not the same input); requests without
    scores in one run are counted as unanswered."""
    by_id = {r.request_id: r for r in reference if r.scores is not None}
    answered = {r.request_id for r in candidate if r.scores is not None}
    unanswered = len(by_id.keys() ^ answered) + sum(
        r.scores is None for records in (reference, candidate) for r in records)
    diverged = _diverged(reference, candidate)
    worst, requests, scores, skipped = 0.0, 0, 0, 0
    paths: Counter[str] = Counter()
    for record in candidate:
        ref = by_id.get(record.request_id)
        if ref is None or record.scores is None or ref.scores is None:
            continue
        if record.request_id > diverged.get(record.user_id, record.request_id) \
                or record.prefix_tokens != ref.prefix_tokens:
            skipped += 1
            continue
        if len(ref.scores) != len(record.scores):
            raise BenchProtocolError(
                f"request {record.request_id}: {reference_mode} scored {len(ref.scores)} "
                f"candidates, {candidate_mode} {len(record.scores)}")
        diff = np.abs(np.asarray(ref.scores, dtype=np.float64)
                      - np.asarray(record.scores, dtype=np.float64))
        if not np.isfinite(diff).all():   # a NaN or inf score: no agreement (max would skip NaN)
            worst = math.inf
        elif len(diff):
            worst = max(worst, float(diff.max()))
        requests += 1
        scores += len(diff)
        paths[record.path] += 1
    return ExactnessReport(reference_mode, candidate_mode, requests, scores, worst,
                           dict(sorted(paths.items())), skipped, unanswered)


async def replay_exactness(reference: SystemFactory, candidate: SystemFactory,
                           workload: Workload, reference_mode: str = "baseline",
                           candidate_mode: str = "relay") -> ExactnessReport:
    """Run ``workload`` through both systems (no SLO, no warm-up) and compare their scores."""
    options = RunOptions(max_in_flight=max(len(workload.requests), 1))
    ref = await run_point(reference, workload, options, keep_scores=True)
    cand = await run_point(candidate, workload, options, keep_scores=True)
    return compare_records(ref.records, cand.records, reference_mode, candidate_mode)
