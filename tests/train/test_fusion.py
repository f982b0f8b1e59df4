"""The cascade's final score: the ranker's plus a weight times the retrieval stage's, and the
weight chosen on validation users."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.data import leave_one_out
from relaygr.errors import ConfigError
from relaygr.model import HSTU
from relaygr.train import TrainConfig, serving_ranks
from relaygr.train.evaluate import CascadeSpec, fuse
from relaygr.train.fusion import fit_stage_weight
from relaygr.train.metrics import RankingMetrics
from relaygr.train.stages import CheckpointRetrieval, HeadRetrieval, Proposals
from tests.train.helpers import cyclic_sequences


def test_fuse_adds_the_weighted_stage_score_to_the_rankers() -> None:
    proposals = Proposals(torch.tensor([[4, 2, 0]]), torch.tensor([[3.0, 2.0, -np.inf]]))
    ranked = [torch.tensor([0.5, 1.5])]
    assert fuse(proposals, ranked, 0.0)[0].tolist() == [0.5, 1.5]     # the ranker alone
    assert fuse(proposals, ranked, 0.5)[0].tolist() == [2.0, 2.5]     # 0.5 + 1.5, 1.5 + 1.0
    with pytest.raises(ConfigError):
        CascadeSpec(HeadRetrieval(None), stage_weight=-1.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        CascadeSpec(HeadRetrieval(None), retrieve_k=0)  # type: ignore[arg-type]


def _models(tmp_path: Path):  # type: ignore[no-untyped-def]
    seqs = cyclic_sequences(tmp_path, num_users=24)
    config = TrainConfig(dim=16, num_layers=1, num_heads=2, max_seq_len=24, dropout=0.0,
                         rank_score="retrieval_residual")
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(HSTU(config.model_config(seqs.num_items)).eval())
    return seqs, models


def test_the_fit_measures_each_weight_as_the_cascade_evaluates_it(tmp_path: Path) -> None:
    """Two models (a ranker and a separate stage): every weight of the grid gives the metrics
    the cascade head reports at that weight, and the chosen one is the best NDCG@10, the
    smallest of equals."""
    seqs, (ranker, stage_model) = _models(tmp_path)
    cases = leave_one_out(seqs).test
    stage = CheckpointRetrieval(stage_model)
    weights = (0.0, 1.0, 2.0)
    fit = fit_stage_weight(ranker, seqs, cases, 24, False, CascadeSpec(stage, 15), weights)
    assert list(fit.metrics) == list(weights)
    for weight in weights:
        ranks = serving_ranks(ranker, seqs, cases, 24, False, ("cascade",),
                              cascade=CascadeSpec(stage, 15, weight))["cascade"]
        assert fit.metrics[weight] == RankingMetrics.from_ranks(ranks)
    best = max(m.ndcg[10] for m in fit.metrics.values())
    assert fit.best == min(w for w, m in fit.metrics.items() if m.ndcg[10] == best)
    assert fit.to_dict()["chosen"] == fit.best
    with pytest.raises(ConfigError):
        fit_stage_weight(ranker, seqs, cases, 24, False, CascadeSpec(stage, 15), (-1.0,))
