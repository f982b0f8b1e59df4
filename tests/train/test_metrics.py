"""Ranks and metrics against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from relaygr.train import RankingMetrics, target_ranks
from relaygr.train.metrics import PairedDifference


def test_ranks_mask_history_and_padding_and_count_ties_against_the_target() -> None:
    scores = torch.tensor([
        [9.0, 0.1, 0.5, 0.9, 0.3, 0.7],   # target 2 (0.5): 0.9 and 0.7 above -> rank 2
        [9.0, 0.1, 0.5, 0.9, 0.3, 0.7],   # same, but 3 and 5 are history -> rank 0
        [0.0, 0.4, 0.4, 0.4, 0.1, 0.2],   # target 1 ties with 2 and 3 -> rank 2 (pessimistic)
        [0.0, 0.8, 0.1, 0.2, 0.3, 0.4],   # target 1 repeats its history: not masked -> rank 0
    ])
    original = scores.clone()
    histories = [np.array([], dtype=np.int64), np.array([3, 5]), np.array([4]), np.array([1, 2])]
    ranks = target_ranks(scores, torch.tensor([2, 2, 1, 1]), histories)
    assert ranks.tolist() == [2, 0, 2, 0]
    assert torch.equal(scores, original)


def test_nan_scores_rank_last() -> None:
    scores = torch.tensor([[0.0, float("nan"), 0.2, 0.3]])
    assert target_ranks(scores, torch.tensor([1]), [np.array([], dtype=np.int64)]).tolist() == [3]


def test_metrics_from_ranks_by_hand() -> None:
    m = RankingMetrics.from_ranks(torch.tensor([0, 9, 10, 60]))
    assert m.hr == {10: 0.5, 50: 0.75, 200: 1.0}
    g = [1.0, 1 / math.log2(11), 1 / math.log2(12), 1 / math.log2(62)]
    assert m.ndcg[10] == pytest.approx((g[0] + g[1]) / 4)
    assert m.ndcg[50] == pytest.approx((g[0] + g[1] + g[2]) / 4)
    assert m.ndcg[200] == pytest.approx(sum(g) / 4)
    assert m.mrr == pytest.approx((1 + 1 / 10 + 1 / 11 + 1 / 61) / 4)
    assert m.num_cases == 4
    assert m.to_dict()["hr@50"] == 0.75


def test_a_paired_difference_is_the_mean_per_case_difference_with_its_standard_error() -> None:
    a = torch.tensor([0, 3, 20, 1])            # hits at 10: 1, 1, 0, 1
    b = torch.tensor([5, 30, 20, 0])           # hits at 10: 1, 0, 0, 1
    hr = PairedDifference.at(a, b, 10, "hr")   # per case: 0, 1, 0, 0
    assert hr.mean == pytest.approx(0.25)
    assert hr.se == pytest.approx(math.sqrt(0.25 / 4))   # sample std 0.5, over sqrt(4)
    ndcg = PairedDifference.at(a, b, 10, "ndcg")
    per_case = [1 - 1 / math.log2(7), 1 / math.log2(5), 0.0, 1 / math.log2(3) - 1]
    assert ndcg.mean == pytest.approx(sum(per_case) / 4)
    same = PairedDifference.at(a, a, 10, "ndcg")
    assert (same.mean, same.se) == (0.0, 0.0)
