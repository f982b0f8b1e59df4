"""Ranking metrics of a held-out item among the full catalogue.

``target_ranks`` turns a score matrix into the 0-based rank of each case's target after masking
the items the user has already interacted with (except the target itself, should it repeat).
Ties count against the target (an item scoring exactly as much is ranked above it), so a model
that scores everything alike earns nothing. From ranks r: HR@K = mean(r < K),
NDCG@K = mean(1 / log2(r + 2) if r < K else 0), MRR = mean(1 / (r + 1)) over the whole list.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

CUTOFFS = (10, 50, 200)


def target_ranks(scores: Tensor, targets: Tensor, histories: Sequence[np.ndarray]) -> Tensor:
    """0-based ranks ``[N]`` of ``targets`` in ``scores``.

    ``scores`` ``[N, num_items + 1]`` (column 0, the padding id, is ignored); ``targets`` ``[N]``
    dense ids; ``histories[j]`` the dense ids case ``j`` must not be recommended (its history).
    ``scores`` is not modified.
    """
    assert scores.dim() == 2 and len(scores) == len(targets) == len(histories)
    device = scores.device
    # a NaN score (a diverged model) ranks last rather than silently first
    scores = torch.nan_to_num(scores.float(), nan=-math.inf)   # a copy: the input stays as is
    targets = targets.to(device)[:, None]                       # [N, 1]
    target_scores = scores.gather(1, targets)                   # [N, 1]
    rows = np.repeat(np.arange(len(histories)), [len(h) for h in histories])
    cols = np.concatenate([np.asarray(h, dtype=np.int64) for h in histories]) if len(rows) \
        else np.zeros(0, dtype=np.int64)
    scores[torch.from_numpy(rows).to(device), torch.from_numpy(cols).to(device)] = -math.inf
    scores[:, 0] = -math.inf
    scores.scatter_(1, targets, target_scores)                  # the target is never masked
    return ((scores >= target_scores).sum(1) - 1).cpu()         # minus the target itself


@dataclass(frozen=True)
class RankingMetrics:
    """HR@K and NDCG@K for ``CUTOFFS``, and MRR, over ``num_cases`` held-out items."""

    hr: dict[int, float]
    ndcg: dict[int, float]
    mrr: float
    num_cases: int

    @classmethod
    def from_ranks(cls, ranks: Tensor | np.ndarray) -> RankingMetrics:
        r = torch.as_tensor(ranks, dtype=torch.float64)
        assert r.numel() > 0, "metrics need at least one case"
        hr = {k: float(_per_case(r, k, "hr").mean()) for k in CUTOFFS}
        ndcg = {k: float(_per_case(r, k, "ndcg").mean()) for k in CUTOFFS}
        return cls(hr=hr, ndcg=ndcg, mrr=float((1.0 / (r + 1.0)).mean()), num_cases=r.numel())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"hr@{k}": v for k, v in self.hr.items()}
        out.update({f"ndcg@{k}": v for k, v in self.ndcg.items()})
        out.update({"mrr": self.mrr, "num_cases": self.num_cases})
        return out

    def summary(self) -> str:
        return (f"HR@10 {self.hr[10]:.4f} NDCG@10 {self.ndcg[10]:.4f} HR@50 {self.hr[50]:.4f} "
                f"NDCG@50 {self.ndcg[50]:.4f} HR@200 {self.hr[200]:.4f} "
                f"NDCG@200 {self.ndcg[200]:.4f} MRR {self.mrr:.4f}")


@dataclass(frozen=True)
class PairedDifference:
    """``a - b`` of a per-case metric over the same cases (``mean``), with the standard error
    of that mean (``se``: the per-case differences' sample standard deviation over sqrt(n)).
    Paired, because both heads rank the same users' targets: a user easy for one is easy for
    the other, so the difference is far less noisy than either metric."""

    mean: float
    se: float

    @classmethod
    def at(cls, a: Tensor, b: Tensor, k: int, metric: str) -> PairedDifference:
        """``metric`` ``"hr"`` or ``"ndcg"`` at cutoff ``k`` of ranks ``a`` minus ranks ``b``."""
        assert a.shape == b.shape and a.numel() > 1, "a paired difference needs >= 2 cases"
        diff = _per_case(a, k, metric) - _per_case(b, k, metric)
        return cls(float(diff.mean()), float(diff.std(unbiased=True) / math.sqrt(diff.numel())))


def _per_case(ranks: Tensor, k: int, metric: str) -> Tensor:
    """Each case's HR@k (hit or not) or NDCG@k (1 / log2(rank + 2) for a hit, else 0)."""
    r = torch.as_tensor(ranks, dtype=torch.float64)
    hit = (r < k).double()
    if metric == "hr":
        return hit
    assert metric == "ndcg", f"unknown metric {metric!r}"
    return hit / torch.log2(r + 2.0)
