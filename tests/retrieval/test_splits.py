"""Protocol splits: disjoint parts, negatives never the user's items, determinism under a seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relaygr.errors import ConfigError, DataFormatError, DatasetNotFoundError
from relaygr.retrieval.data import load_pair
from relaygr.retrieval.splits import (
    DomainSplit,
    Protocol,
    SplitKind,
    hold_out_one,
    make_split,
    sample_negatives,
)
from tests.retrieval.conftest import write_pair


def test_hold_out_one_takes_exactly_one_item_of_each_chosen_user() -> None:
    pairs = np.array([[0, 1], [0, 2], [0, 3], [1, 4], [2, 5], [2, 6]])
    rest, held = hold_out_one(pairs, np.array([0, 1, 2]), np.random.default_rng(0))
    assert sorted(held[:, 0].tolist()) == [0, 2]          # user 1 has a single item: kept
    assert len(rest) + len(held) == len(pairs)
    assert set(map(tuple, rest.tolist())) | set(map(tuple, held.tolist())) == set(
        map(tuple, pairs.tolist()))


def test_negatives_avoid_every_item_the_user_touched() -> None:
    seen = np.array([[0, 0], [0, 1], [0, 2], [1, 3]])
    rows = np.array([[0, 0], [1, 3]])
    negs = sample_negatives(rows, seen, num_items=6, k=3, rng=np.random.default_rng(0))
    assert sorted(negs[0].tolist()) == [3, 4, 5]          # the only three left for user 0
    assert 3 not in negs[1] and len(set(negs[1].tolist())) == 3
    with pytest.raises(ConfigError):
        sample_negatives(rows, seen, num_items=6, k=4, rng=np.random.default_rng(0))


@pytest.mark.parametrize("kind", list(SplitKind))
def test_split_invariants_and_determinism(pair_dir: Path, kind: SplitKind) -> None:
    pair = load_pair(pair_dir, "aa_bb")
    assert pair.num_users == 40 and [d.name for d in pair.domains] == ["aa", "bb"]
    for domain in pair.domains:
        split = make_split(domain, kind, seed=3, valid_share=0.5)
        seen = np.concatenate([domain.train, domain.test, domain.test_original])
        split.check(seen)
        k = 99 if kind is SplitKind.CVGAE else 999
        assert split.test_negatives.shape == (len(split.test), k)
        assert split.valid_negatives.shape == (len(split.valid), k)
        again = make_split(domain, kind, seed=3, valid_share=0.5)
        np.testing.assert_array_equal(split.test_negatives, again.test_negatives)
        np.testing.assert_array_equal(split.train, again.train)
        other = make_split(domain, kind, seed=4, valid_share=0.5)
        assert not np.array_equal(split.valid_negatives, other.valid_negatives)


def test_too_small_a_catalogue_for_the_negatives_is_a_config_error(tmp_path: Path) -> None:
    domain = load_pair(write_pair(tmp_path, items=(60, 50)), "aa_bb").target
    with pytest.raises(ConfigError):        # 60 items, 7 seen per user: 99 negatives impossible
        make_split(domain, SplitKind.CVGAE, seed=0, valid_share=0.5)


def test_disencdr_uses_the_released_test_and_cvgae_the_merged_files(pair_dir: Path,
                                                                     tmp_path: Path) -> None:
    domain = load_pair(pair_dir, "aa_bb").target
    split = make_split(domain, SplitKind.DISENCDR, seed=0, valid_share=0.5)
    np.testing.assert_array_equal(split.test, domain.test)
    assert len(split.train) + len(split.valid) == len(domain.train)
    cv = make_split(domain, SplitKind.CVGAE, seed=0, valid_share=0.5)
    assert len(cv.test) == 40 and len(cv.train) + len(cv.valid) + 40 == 40 * 7
    path = tmp_path / "s.npz"
    cv.save(path)
    back = DomainSplit.load(path, "aa")
    np.testing.assert_array_equal(back.test_negatives, cv.test_negatives)
    assert back.kind is SplitKind.CVGAE and back.num_items == cv.num_items


def test_protocols_and_bad_input(tmp_path: Path, pair_dir: Path) -> None:
    assert Protocol.parse("full").split_kind is SplitKind.DISENCDR
    assert Protocol.parse("cvgae").split_kind is SplitKind.CVGAE
    with pytest.raises(ConfigError):
        Protocol.parse("loo")
    with pytest.raises(DatasetNotFoundError):
        load_pair(pair_dir, "aa_cc")
    (pair_dir / "aa_bb" / "train.txt").write_text("0 1 1\n0 x 1\n")
    with pytest.raises(DataFormatError, match=r"train.txt:2"):
        load_pair(pair_dir, "aa_bb")


def test_disencdr_negatives_are_never_items_only_a_held_out_row_names(pair_dir: Path) -> None:
    """DisenCDR draws its negatives among train.txt's items: an id the files name only in
    held-out rows has no training interaction, so any popularity prior beats it for free."""
    domain = load_pair(pair_dir, "aa_bb").target
    held_only = np.setdiff1d(np.concatenate([domain.test[:, 1], domain.test_original[:, 1]]),
                             domain.train[:, 1])
    assert len(held_only)                      # the generated files have such items
    for seed in range(3):
        split = make_split(domain, SplitKind.DISENCDR, seed=seed, valid_share=0.5)
        assert not np.isin(split.test_negatives, held_only).any()
        assert not np.isin(split.valid_negatives, held_only).any()
    cv = make_split(domain, SplitKind.CVGAE, seed=0, valid_share=0.5)   # CVGAE's: any item
    assert np.isin(cv.test_negatives, held_only).any()
