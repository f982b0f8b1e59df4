"""Ranks and metrics on hand-made scores."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from relaygr.retrieval.evaluate import (
    PopularityScorer,
    VectorScorer,
    full_ranks,
    hits,
    hr_ndcg,
    sampled_ranks,
)


def test_sampled_ranks_count_the_negatives_scoring_higher() -> None:
    # one user; item vectors on a line so item i scores i
    scorer = VectorScorer({"d": np.array([[1.0]], np.float32)},
                          {"d": np.arange(8, dtype=np.float32)[:, None]})
    rows = np.array([[0, 5], [0, 1]])
    negs = np.array([[7, 2, 3], [2, 3, 4]])
    assert sampled_ranks(scorer, "d", rows, negs).tolist() == [1, 3]


def test_ties_are_broken_at_random_but_reproducibly() -> None:
    pop = PopularityScorer({"d": np.zeros(10, np.float32)})   # every item tied
    rows = np.zeros((2000, 2), np.int64)
    negs = np.tile(np.arange(1, 10), (2000, 1))
    ranks = sampled_ranks(pop, "d", rows, negs)
    assert set(ranks.tolist()) == set(range(10))
    assert abs(ranks.mean() - 4.5) < 0.3        # uniform over 0..9
    np.testing.assert_array_equal(ranks, sampled_ranks(pop, "d", rows, negs))


def test_hr_and_ndcg_exact() -> None:
    m = hr_ndcg(np.array([0, 1, 9, 10]), k=10)
    assert m["hr@10"] == 0.75
    expected = (1.0 + 1.0 / math.log2(3) + 1.0 / math.log2(11)) / 4
    assert abs(m["ndcg@10"] - expected) < 1e-12
    assert hits(np.array([0, 49, 50, 199, 200]), (50, 200)) == {"hit@50": 0.4, "hit@200": 0.8}


def test_full_ranks_mask_the_users_known_items() -> None:
    scorer = VectorScorer({"d": np.array([[1.0], [1.0]], np.float32)},
                          {"d": np.arange(6, dtype=np.float32)[:, None]})
    rows = np.array([[0, 2], [1, 2]])
    known = np.array([[0, 5], [0, 4]])                 # user 0 bought the two top items
    assert full_ranks(scorer, "d", rows, 6, known).tolist() == [1, 3]


def test_a_baseline_on_other_negatives_is_refused() -> None:
    import pytest

    from relaygr.errors import CheckpointError
    from relaygr.retrieval.report import _same_splits, mean_std
    from relaygr.retrieval.splits import DomainSplit, SplitKind

    rows = np.array([[0, 1]])

    def split(negs: list[int]) -> DomainSplit:
        return DomainSplit("d", SplitKind.CVGAE, 9, rows, rows, rows, np.array([negs]),
                           np.array([negs]))

    _same_splits({"d": split([2, 3])}, {"d": split([2, 3])}, Path("same"))
    with pytest.raises(CheckpointError):
        _same_splits({"d": split([2, 3])}, {"d": split([2, 4])}, Path("other"))
    summary = mean_std([{"d": {"hr@10": 0.2}}, {"d": {"hr@10": 0.4}}])
    assert summary["d"]["hr@10"] == pytest.approx(0.3)
    assert summary["d"]["hr@10_std"] == pytest.approx(0.1)
