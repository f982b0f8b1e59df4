"""Losses: sampled softmax for the retrieval head and for the ranking head.

Retrieval (HSTU paper, open-source ``SampledSoftmaxLoss``): at every valid position the logit of
the true next item competes with ``K`` uniformly sampled items; a sampled item equal to the
positive is masked out. Logits are ``retrieval_query(h) · item_vectors(id)``, i.e. cosine / τ
under the recipe, exactly what ``HSTU.retrieval_scores`` computes at evaluation.

Ranking: the candidates (positive first, then uniform negatives) are target tokens of
``HSTU.rank_padded``, the function ``HSTU.rank`` serves; a softmax over them ranks the positive
first. A softmax (not a per-candidate BCE) because the offline protocol ranks the true item
against the whole catalogue and MovieLens has no negative labels, only unobserved items.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relaygr.model import HSTU
from relaygr.train.batches import RankBatch, TrainBatch

# Logit given to a sampled negative that equals the positive (the reference code's -5e4): far
# below any real logit, finite so no NaN appears in a softmax row.
_MASKED_LOGIT = -5e4


def _softmax_first_sum(pos_logits: Tensor, neg_logits: Tensor, neg_is_pos: Tensor) -> Tensor:
    """Cross entropy of the positive (column 0) against masked negatives, summed over rows."""
    neg_logits = neg_logits.masked_fill(neg_is_pos, _MASKED_LOGIT)
    logits = torch.cat([pos_logits[:, None], neg_logits], dim=1)
    zeros = torch.zeros(len(logits), dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, zeros, reduction="sum")


# Logits of at most this many bytes per block of positions in the catalogue softmax: below
# glibc's largest mmap threshold (32 MiB), so the blocks reuse heap memory instead of mapping and
# faulting in fresh pages every step (which cost ~30% of a training step as system time).
_CATALOGUE_BLOCK_BYTES = 24 << 20


def _catalogue_softmax_sum(query: Tensor, items_t: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of ``query @ items_t`` against ``targets``, summed in blocks of positions."""
    step = max(1, _CATALOGUE_BLOCK_BYTES // (items_t.element_size() * items_t.shape[1]))
    total = query.new_zeros(())
    for start in range(0, len(query), step):
        block = query[start:start + step] @ items_t
        total = total + F.cross_entropy(block, targets[start:start + step], reduction="sum")
    return total


def retrieval_loss(model: HSTU, batch: TrainBatch, num_negatives: int, sharing: str,
                   gen: torch.Generator, denominator: float | None = None) -> Tensor:
    """Sampled softmax of next-item prediction at every non-padding position of ``batch``.

    ``sharing`` is "position" (negatives drawn per position), "sequence" (one draw per row,
    used by all its positions) or "catalogue" (every other item is a negative: the exact
    softmax, ``num_negatives`` unused). Negatives are drawn on the CPU from ``gen``. The
    per-position losses are summed and divided by ``denominator`` (None: their mean).
    """
    device = model.device
    hidden = model.encode_padded(batch.inputs, batch.timestamps, batch.query_timestamps,
                                 batch.timed)                             # [B, T, d]
    valid = batch.targets != 0                                            # [B, T]
    query = model.retrieval_query(hidden)                                 # [B, T, d]
    targets = batch.targets[valid]                                        # [N]
    pos_logits = (query[valid] * model.item_vectors(targets)).sum(-1)     # [N]
    high = model.cfg.num_items + 1
    denominator = len(targets) if denominator is None else denominator
    if sharing == "catalogue":                                            # the exact softmax
        total = _catalogue_softmax_sum(query[valid], model.item_embeddings().t(), targets - 1)
        return total / denominator
    if sharing == "position":
        neg_ids = torch.randint(1, high, (len(targets), num_negatives), generator=gen)
        neg_ids = neg_ids.to(device)
        neg_vecs = model.item_vectors(neg_ids)                            # [N, K, d]
        neg_logits = torch.einsum("nd,nkd->nk", query[valid], neg_vecs)
        neg_is_pos = neg_ids == targets[:, None]
    else:
        rows = len(batch.inputs)
        neg_ids = torch.randint(1, high, (rows, num_negatives), generator=gen).to(device)
        neg_vecs = model.item_vectors(neg_ids)                            # [B, K, d]
        neg_logits = torch.bmm(query, neg_vecs.transpose(1, 2))[valid]   # [N, K]
        neg_is_pos = neg_ids[:, None, :].expand(-1, valid.shape[1], -1)[valid] == targets[:, None]
    return _softmax_first_sum(pos_logits, neg_logits, neg_is_pos) / denominator


def ranking_loss(model: HSTU, batch: RankBatch, temperature: float = 1.0,
                 head_only: bool = False) -> Tensor:
    """Sampled softmax of the ranking head over ``batch.candidates`` (positive in column 0), at
    ``temperature`` (a monotone rescaling of the scores: it changes how fast the head learns,
    not which candidate ``rank`` puts first). ``head_only``: the gradient reaches the head's
    MLP only; the layers below are computed without a graph (the retrieval loss alone trains
    them)."""
    if head_only:
        with torch.no_grad():
            states = model.candidate_states_padded(batch.history, batch.candidates,
                                                   batch.timestamps, batch.query_timestamps,
                                                   batch.timed)
            prior = model.rank_prior(states.user, batch.candidates)               # [R, C]
        scores = model.rank_logits(states.candidates, prior)                       # [R, C]
    else:
        scores = model.rank_padded(batch.history, batch.candidates, batch.timestamps,
                                   batch.query_timestamps, batch.timed)
    scores = scores / temperature
    neg_is_pos = batch.candidates[:, 1:] == batch.candidates[:, :1]
    return _softmax_first_sum(scores[:, 0], scores[:, 1:], neg_is_pos) / len(scores)
