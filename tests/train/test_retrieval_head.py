"""The model's retrieval head options (the one model edit training needed): cosine / τ."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relaygr.errors import ConfigError
from relaygr.model import HSTU, HSTUConfig
from tests.tolerance import reorder_tolerance


def _model(**overrides: object) -> HSTU:
    torch.manual_seed(0)
    return HSTU(HSTUConfig(num_items=30, dim=8, num_layers=1, num_heads=2, max_seq_len=16,
                           **overrides))  # type: ignore[arg-type]


def test_dot_is_the_default_and_unchanged() -> None:
    model = _model()
    user = torch.randn(3, 8)
    assert torch.equal(model.retrieval_scores(user), user @ model.item_emb.weight.t())
    assert torch.equal(model.item_embeddings(), model.item_emb.weight[1:])
    assert torch.equal(model.retrieval_query(user), user)


def test_cosine_with_temperature() -> None:
    model = _model(retrieval_similarity="cosine", retrieval_temperature=0.05)
    user = torch.randn(3, 8)
    expected = F.normalize(user, dim=-1) @ F.normalize(model.item_emb.weight[1:], dim=-1).t()
    scores = model.retrieval_scores(user)
    # cosines (dot products of 8 unit-vector terms, |sum| <= 1) scaled by 1 / 0.05
    tol = reorder_tolerance(terms=8, abs_sum=1 / 0.05, chained=2)
    torch.testing.assert_close(scores[:, 1:], expected / 0.05, rtol=0.0, atol=tol)
    torch.testing.assert_close(model.retrieval_query(user) @ model.item_embeddings().t(),
                               scores[:, 1:], rtol=0.0, atol=tol)
    ids = torch.tensor([[1, 5], [30, 2]])
    torch.testing.assert_close(model.item_vectors(ids), model.item_embeddings()[ids - 1],
                               rtol=0.0, atol=tol)
    assert torch.equal(scores[:, 0], torch.zeros(3))  # the padding row stays at zero


def test_bad_retrieval_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="retrieval_similarity"):
        HSTUConfig(num_items=3, dim=8, num_heads=2, retrieval_similarity="l1")
    with pytest.raises(ConfigError, match="retrieval_temperature"):
        HSTUConfig(num_items=3, dim=8, num_heads=2, retrieval_temperature=0.0)
