"""Hard negatives for the ranking head: what the retrieval stage would have proposed.

A cascade's ranker only ever scores the retrieval stage's top K, so uniform negatives teach it
the easy part (telling a relevant item from a random one), which retrieval already did. Here
each ranking example's history is encoded once more, without a graph and in eval mode (no
dropout: the proposals the cascade would really make), the retrieval head's top ``pool`` items
are taken with the history's own items excluded (as the cascade excludes them), and
``num_hard`` of them, drawn uniformly without replacement, replace the first negatives of the
row. A drawn item may be the positive itself; the ranking loss masks such a negative.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from relaygr.errors import ConfigError
from relaygr.model import HSTU
from relaygr.train.batches import RankBatch


def retrieval_top_k(model: HSTU, history: Tensor, timestamps: Tensor | None, k: int,
                    query_timestamps: Tensor | None = None,
                    timed: Tensor | None = None) -> Tensor:
    """``[R, T]`` right-padded histories → ``[R, k]`` the retrieval head's best ``k`` item ids
    after each history, best first, none of them in the history; ``query_timestamps`` ``[R]``
    (default: the last history timestamps) the request times, which a timed model with
    ``time_query="next"`` measures its last token from; ``timed`` ``[R]`` which rows are timed
    (None: all). Runs under ``no_grad`` in eval mode and restores the model's mode."""
    if k > model.cfg.num_items - history.shape[1]:
        raise ConfigError(f"cannot mine {k} items from a catalogue of {model.cfg.num_items} "
                          f"after removing up to {history.shape[1]} history items")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            lengths = (history != 0).sum(1)
            hidden = model.encode_padded(history, timestamps, query_timestamps,
                                         timed)                                  # [R, T, d]
            last = (lengths - 1).clamp(min=0)                                    # [R]
            user = hidden[torch.arange(len(history), device=history.device), last]
            scores = model.retrieval_scores(user)                                # [R, N + 1]
            scores.scatter_(1, history, -math.inf)       # the history (0, padding, among it)
            scores[:, 0] = -math.inf
            return scores.topk(k, dim=1).indices                                 # [R, k]
    finally:
        model.train(was_training)


def with_hard_negatives(model: HSTU, batch: RankBatch, num_hard: int, pool: int,
                        gen: torch.Generator, reads_time: bool = True) -> RankBatch:
    """``batch`` with candidate columns ``1..num_hard`` replaced by items drawn uniformly
    without replacement from ``model``'s retrieval head's top ``pool`` for each row's history.
    ``reads_time``: ``model`` reads the batch's timestamps (the model being trained); False
    for a position-only stage run (``stage_runs``), which proposes without time wherever it
    serves, so it mines without it too. The draw uses ``gen`` (a CPU generator, as every draw
    of training); the batch is not modified."""
    if num_hard == 0:
        return batch
    top = retrieval_top_k(model, batch.history, batch.timestamps, pool,
                          batch.query_timestamps, batch.timed) if reads_time else \
        retrieval_top_k(model, batch.history, None, pool)                       # [R, pool]
    rows = len(batch.history)
    picks = torch.rand((rows, pool), generator=gen).argsort(1)[:, :num_hard]   # [R, num_hard]
    hard = top.gather(1, picks.to(top.device))
    candidates = batch.candidates.clone()
    candidates[:, 1:1 + num_hard] = hard
    return replace(batch, candidates=candidates)
