"""Ranks and metrics on hand-made scores."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from relaygr.retrieval.evaluate import (
    ItemCFScorer,
    PopularityScorer,
    SumScorer,
    VectorScorer,
    full_ranks,
    hits,
    hr_ndcg,
    sampled_ranks,
)
from relaygr.retrieval.report import choose_fusion_weight, item_cf
from relaygr.retrieval.splits import DomainSplit, SplitKind


def test_sampled_ranks_count_the_negatives_scoring_higher() -> None:
    # one user; item vectors on a line so item i scores i
    scorer = VectorScorer({"d": np.array([[1.0]], np.float32)},
                          {"d": np.arange(8, dtype=np.float32)[:, None]})
    rows = np.array([[0, 5], [0, 1]])
    negs = np.array([[7, 2, 3], [2, 3, 4]])
    assert sampled_ranks(scorer, "d", rows, negs).tolist() == [1, 3]


def test_a_nan_score_is_a_miss_not_a_hit() -> None:
    """NaN compares False with anything: counted as it was, a NaN item had no negative above
    it and read as ranked first (a diverged model scored HR@10 = 1.0)."""
    nan_users = VectorScorer({"d": np.full((1, 1), np.nan, np.float32)},
                             {"d": np.arange(8, dtype=np.float32)[:, None]})
    rows = np.array([[0, 5], [0, 1]])
    negs = np.array([[7, 2, 3], [2, 3, 4]])
    assert sampled_ranks(nan_users, "d", rows, negs).tolist() == [4, 4]
    assert full_ranks(nan_users, "d", rows, 8, np.empty((0, 2), np.int64)).tolist() == [8, 8]
    items = np.arange(8, dtype=np.float32)[:, None]
    items[5] = np.nan                                  # one item's score NaN, the rest finite
    one = VectorScorer({"d": np.array([[1.0]], np.float32)}, {"d": items})
    assert sampled_ranks(one, "d", rows, negs).tolist() == [4, 3]
    assert full_ranks(one, "d", rows, 8, np.empty((0, 2), np.int64)).tolist() == [8, 5]


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
    # the same test rows and negatives, other training rows (another valid_share, say)
    other_train = DomainSplit("d", SplitKind.CVGAE, 9, np.array([[0, 5]]), rows, rows,
                              np.array([[2, 3]]), np.array([[2, 3]]))
    with pytest.raises(CheckpointError):
        _same_splits({"d": split([2, 3])}, {"d": other_train}, Path("trained otherwise"))
    summary = mean_std([{"d": {"hr@10": 0.2}}, {"d": {"hr@10": 0.4}}])
    assert summary["d"]["hr@10"] == pytest.approx(0.3)
    assert summary["d"]["hr@10_std"] == pytest.approx(0.1)


def test_item_cf_sums_cosines_to_the_users_items_in_both_domains() -> None:
    # users 0-3; domain a: 3 items, domain b: 2 items
    a = np.array([[0, 0], [0, 1], [1, 0], [1, 1], [2, 2], [3, 0]])
    b = np.array([[0, 0], [1, 0], [2, 1], [3, 0], [3, 1]])
    cf = ItemCFScorer.of({"a": a, "b": b}, {"a": 3, "b": 2}, num_users=4, prior_weight=0.5)
    deg_a = np.array([3, 2, 1])           # users of a's items
    deg_b = np.array([3, 2])
    # user 2: a-item 2 and b-item 1. Score of a-item 0: within a, items 2 and 0 share no user;
    # across, b-item 1 and a-item 0 share user 3: 1 / sqrt(2 * 3)
    want = 1 / math.sqrt(2 * 3) + 0.5 * math.log1p(deg_a[0])
    got = cf.scores("a", np.array([2]), np.array([0, 1, 2]))
    assert got.shape == (1, 3) and got.dtype == np.float32
    assert math.isclose(float(got[0, 0]), want, rel_tol=1e-6)
    # an item never scores itself: a-item 2's only user is user 2, so only the prior is left
    # within a, and b-item 1 shares user 2 with it: 1 / sqrt(2 * 1)
    want_2 = 1 / math.sqrt(2 * 1) + 0.5 * math.log1p(deg_a[2])
    assert math.isclose(float(got[0, 2]), want_2, rel_tol=1e-6)
    # per-row candidates give the same numbers as the shared list, in blocks of any size
    users = np.array([0, 1, 2, 3])
    shared = cf.scores("b", users, np.array([0, 1]))
    per_row = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    rows = cf.scores("b", users, per_row, block=3)
    np.testing.assert_array_equal(rows, np.take_along_axis(shared, per_row, axis=1))
    # user 0 (a-items 0, 1; b-item 0). b-item 0: across, a-item 0 shares all 3 of its users
    # (3 / sqrt(3 * 3)) and a-item 1 both of its (2 / sqrt(2 * 3)); itself is not counted.
    # b-item 1: within, b-item 0 shares user 3 (1 / sqrt(3 * 2)); across, a-item 0 too
    want_0 = 1.0 + 2 / math.sqrt(6) + 0.5 * math.log1p(deg_b[0])
    want_1 = 2 / math.sqrt(6) + 0.5 * math.log1p(deg_b[1])
    np.testing.assert_allclose(shared[0], [want_0, want_1], rtol=1e-6)


def test_sum_scorer_adds_the_weighted_second_channel() -> None:
    pop = PopularityScorer({"a": np.array([1.0, 5.0, 2.0], np.float32)})
    vec = VectorScorer({"a": np.eye(2, dtype=np.float32)},
                       {"a": np.array([[1, 0], [0, 1], [1, 1]], np.float32)})
    items = np.array([0, 1, 2])
    users = np.array([0, 1])
    np.testing.assert_array_equal(SumScorer(vec, pop, 0.0).scores("a", users, items),
                                  vec.scores("a", users, items))
    np.testing.assert_allclose(SumScorer(vec, pop, 0.5).scores("a", users, items),
                               [[1.5, 2.5, 2.0], [0.5, 3.5, 2.0]])


def test_the_fusion_weight_is_chosen_on_validation_rows_only() -> None:
    """Validation needs item-CF's weight >= 1 to rank its item first, test needs it below 0.6:
    the weight follows validation (the first of the grid's equals), and item-CF is built from
    the training rows alone."""
    # model: item values (one-dimensional vectors, user vector 1); other: per-item counts
    model = VectorScorer({"a": np.ones((2, 1), np.float32)},
                         {"a": np.array([[0.0], [0.0], [0.6], [0.6], [0.0]] + [[-10.0]] * 7,
                                        np.float32)})
    other = PopularityScorer({"a": np.array([0, 1, 0, 0, 1] + [0] * 7, np.float32)})
    train = np.array([[0, 0], [1, 0], [1, 5]])
    split = DomainSplit("a", SplitKind.CVGAE, 12, train,
                        valid=np.array([[0, 1]]), test=np.array([[0, 3]]),
                        valid_negatives=np.array([[2, 5, 6, 7, 8, 9, 10, 11]]),
                        test_negatives=np.array([[4, 5, 6, 7, 8, 9, 10, 11]]))
    assert choose_fusion_weight(model, other, {"a": split}) == 1.0
    built = item_cf({"a": split}, num_users=2)
    alone = ItemCFScorer.of({"a": train}, {"a": 12}, num_users=2)
    items = np.arange(12)
    np.testing.assert_array_equal(built.scores("a", np.array([0, 1]), items),
                                  alone.scores("a", np.array([0, 1]), items))
