"""A visit to the cascade and its answer: the request path's messages at its boundary.

``Visit`` is one request (a user, the events since their last visit, the request time),
``Recommendation`` what the cascade answers it with (the ranked candidates and how they were
made), and ``SystemCounters`` what ``cascade.request_path.RequestPath`` counts across visits.
The embedded system, the Ray ingress, the server and the benchmark speak in these.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import Tensor

from relaygr.cascade.stages import StageTiming
from relaygr.engine.types import PreinferResult, RankPath, RankTiming
from relaygr.train.stages import fused_scores


@dataclass(frozen=True)
class Visit:
    """One request: a user, the behaviours since their last visit, and the request time."""

    user_id: int
    recent_items: tuple[int, ...] = ()
    recent_timestamps: tuple[int, ...] | None = None
    request_ts: int | None = None
    num_candidates: int | None = None     # None: the system's default
    # the user's event count the caller expects before the visit's own events are appended
    # (the append's precondition, ``HistoryStore.append``); None: no precondition
    expected_events: int | None = None


@dataclass(frozen=True)
class Recommendation:
    """Candidates (best retrieval order) and their ranking scores, with how they were made.

    ``scores`` are the ranker's, exact whatever the path (cached or full); ``stage_scores`` the
    retrieval stage's score of each candidate (None: no stage ran, as for given candidates);
    the recommendation's order is by ``final_scores``, the two fused after ranking."""

    candidates: Tensor
    scores: Tensor
    path: RankPath
    instance: str                  # the instance that ranked
    preinfer: PreinferResult | None
    preinfer_instance: str | None  # the instance that got the pre-infer signal
    prefix_tokens: int
    suffix_tokens: int
    ranking_due_s: float       # time.perf_counter() when ranking was due
    ranking_done_s: float
    timing: RankTiming | None = None   # inside the ranking instance (None: not reported)
    window_start: int = 0      # the history event the model read first (cascade.window)
    stages: StageTiming | None = None  # retrieval and delays before ranking (None: no stages)
    stage_scores: Tensor | None = None
    stage_weight: float = 0.0          # of stage_scores in final_scores (0: the ranker alone)

    @property
    def final_scores(self) -> Tensor:
        """``scores + stage_weight x stage_scores`` (``train.stages.fused_scores``, the formula
        of ``relaygr eval``'s cascade); ``scores`` when the weight is 0."""
        if self.stage_weight == 0:
            return self.scores
        assert self.stage_scores is not None, "a fused recommendation needs the stage's scores"
        return fused_scores(self.scores, self.stage_scores, self.stage_weight)


@dataclass
class SystemCounters:
    """What the request path did, cumulative: requests, failovers, shedding, the ranking paths
    taken (read by health and metrics)."""

    requests: int = 0
    failovers: int = 0           # ranking legs answered elsewhere: instance gone, raised, or out
    shed_preinfer: int = 0
    shed_rank: int = 0
    # pre-infer signals that did nothing: instance gone, raised, or its ranking leg failed over
    lost_preinfer: int = 0
    instance_errors: int = 0     # failovers whose instance raised (its fault, not the request's)
    paths: Counter[str] = field(default_factory=Counter)
    window_slides: int = 0       # appends that moved a user's window (its cache is recomputed)
    windowed_requests: int = 0   # ranked from a window that starts after the first event
