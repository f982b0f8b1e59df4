"""Choosing the weight of the retrieval stage's score in the cascade's final score.

A cascade ranks the stage's K proposals by ``ranker score + w x stage score``
(``evaluate.CascadeSpec``). ``w`` is chosen by measurement on validation users (never on the
users a figure is reported for): every weight of a grid is scored from one pass of the stage and
the ranker, and the best NDCG@10 (the trainer's selection metric) wins; a tie goes to the
smaller weight, the ranker's own order being the simpler model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relaygr.data.sequences import UserSequences
from relaygr.data.split import EvalCases
from relaygr.errors import ConfigError
from relaygr.model import HSTU
from relaygr.train.evaluate import (
    CascadeSpec,
    cascade_ranks,
    fuse,
    prefilled_batches,
    ranked_proposals,
)
from relaygr.train.metrics import RankingMetrics

# From the ranker alone (0) to the stage weighing three times the ranker: the ranker's and the
# stage's scores are both logits at the same temperature, so the optimum sits near 1 when the
# two models are about as good.
STAGE_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


@dataclass(frozen=True)
class StageWeightFit:
    """The cascade's metrics at each weight of the grid, and the chosen weight."""

    metrics: dict[float, RankingMetrics]
    best: float

    def to_dict(self) -> dict[str, object]:
        return {"chosen": self.best, "by": "ndcg@10",
                "grid": {str(w): {"hr@10": m.hr[10], "ndcg@10": m.ndcg[10]}
                         for w, m in self.metrics.items()}}


@torch.inference_mode()
def fit_stage_weight(model: HSTU, seqs: UserSequences, cases: EvalCases, max_seq_len: int,
                     use_timestamps: bool, cascade: CascadeSpec,
                     weights: tuple[float, ...] = STAGE_WEIGHTS, batch_users: int = 8,
                     progress: bool = False) -> StageWeightFit:
    """The cascade of ``cascade``'s stage and K at every weight of ``weights`` on ``cases``
    (its own ``stage_weight`` is ignored)."""
    if not weights or any(w < 0 for w in weights):
        raise ConfigError(f"stage weights must be a non-empty grid of weights >= 0: {weights}")
    model.eval()
    ranks: dict[float, list[Tensor]] = {w: [] for w in weights}
    for rows, win, prefixes in prefilled_batches(model, seqs, cases, max_seq_len,
                                                 use_timestamps, batch_users, progress):
        proposals, ranked = ranked_proposals(model, cases, rows, win, prefixes, cascade)
        for weight in weights:
            ranks[weight].append(cascade_ranks(proposals, fuse(proposals, ranked, weight),
                                               win.targets, win.excluded, model.cfg.num_items))
    metrics = {w: RankingMetrics.from_ranks(torch.cat(r)) for w, r in ranks.items()}
    best = max(sorted(weights), key=lambda w: metrics[w].ndcg[10])   # first max: the smallest
    return StageWeightFit(metrics, best)
