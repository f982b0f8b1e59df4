"""The ranking head's score: an MLP on the candidate token's state, plus (under
``rank_score="retrieval_residual"``) the retrieval head's logit of the candidate."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from relaygr.model import HSTU, RankInput
from tests.model.helpers import make_model, random_history

DIM = 32
# The retrieval logit is a dot product of two dim-long float32 vectors scaled by 1 / temperature
# (20 here, logits up to |20|); computed by a matmul in ``retrieval_scores`` and by a row-wise
# sum in ``rank``, the two may differ by the reduction's rounding: dim * eps * max |logit|.
TEMPERATURE = 0.05
TOLERANCE = DIM * torch.finfo(torch.float32).eps * (1 / TEMPERATURE)


def _residual_model(seed: int, zero_mlp: bool) -> HSTU:
    model = make_model(seed, dim=DIM, rank_score="retrieval_residual",
                       retrieval_similarity="cosine", retrieval_temperature=TEMPERATURE)
    if zero_mlp:
        with torch.no_grad():
            last = cast(nn.Linear, model.rank_head[-1])
            last.weight.zero_()
            last.bias.zero_()
    return model


def test_residual_head_with_a_silent_mlp_scores_what_retrieval_scores() -> None:
    model = _residual_model(0, zero_mlp=True)
    items, _ = random_history(torch.Generator().manual_seed(0), 150, 500, timed=False)
    kv = model.prefill(items)
    cands = torch.tensor([1, 7, 250, 499, 500, 7])
    scores = model.rank(cands, prefix=kv)
    retrieval = model.retrieval_scores(kv.last_hidden)[cands]
    assert (scores - retrieval).abs().max() <= TOLERANCE
    # the retrieval logit varies over these candidates, so the head really carries it
    assert retrieval.max() - retrieval.min() > 100 * TOLERANCE


def test_residual_is_the_mlp_plus_the_retrieval_logit() -> None:
    """Same weights under both heads: the scores differ by exactly the retrieval logit."""
    residual = _residual_model(1, zero_mlp=False)
    state = make_model(1, dim=DIM, retrieval_similarity="cosine",
                       retrieval_temperature=TEMPERATURE)
    state.load_state_dict(residual.state_dict())   # same parameters: the head adds none
    items, _ = random_history(torch.Generator().manual_seed(1), 80, 500, timed=False)
    kv = residual.prefill(items)
    cands = torch.arange(1, 41)
    [with_prior, without] = [m.rank_batch([RankInput(cands, prefix=kv)])[0]
                             for m in (residual, state)]
    retrieval = residual.retrieval_scores(kv.last_hidden)[cands]
    assert (with_prior - without - retrieval).abs().max() <= 2 * TOLERANCE
