"""The loaders on the shared MovieLens files (skipped when ../shared/datasets is absent)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from relaygr.data import (
    UserSequences,
    build_sequences,
    check_times,
    check_user_ids,
    leave_one_out,
    load_sequences,
    resolve,
)

DATASETS = Path(__file__).resolve().parents[2].parent / "shared" / "datasets"
ML1M = DATASETS / "ml-1m"
ML100K = DATASETS / "ml-100k"
pytestmark = pytest.mark.skipif(not ML1M.is_dir(), reason="shared datasets not present")


def test_ml1m_shared_table_and_original_ratings_dat_agree() -> None:
    ordered = load_sequences("ml-1m", ML1M)
    assert (ordered.num_users, ordered.num_items, ordered.num_events) == (6040, 3706, 1000209)
    # users 3000-6040 have no timestamps in the shared table
    assert ordered.timed.tolist() == [u < 3000 for u in ordered.user_ids.tolist()]
    original = load_sequences("ratings-dat", ML1M / "ratings_users_1-2999.dat.gz")
    assert (original.num_users, original.num_events) == (2999, 487650)
    assert original.all_timed
    # same events with the same timestamps in the same order, user by user (ratings given in
    # the same second may be listed in another order, so items are compared per user as sets)
    end = int(ordered.offsets[original.num_users])
    assert np.array_equal(ordered.offsets[:original.num_users + 1], original.offsets)
    assert np.array_equal(ordered.timestamps[:end], original.timestamps)
    assert np.array_equal(ordered.user_ids[:original.num_users], original.user_ids)
    assert original.user_ids.tolist() == list(range(1, 3000))
    users = np.repeat(np.arange(original.num_users), original.lengths)

    def per_user_sorted(seqs: UserSequences, dense: np.ndarray) -> np.ndarray:
        items = seqs.id_map.original_ids(dense).astype(np.int64)
        return items[np.lexsort((items, users))]

    assert np.array_equal(per_user_sorted(ordered, ordered.items[:end]),
                          per_user_sorted(original, original.items))
    split = leave_one_out(ordered)
    assert len(split.test) == len(split.valid) == 6040
    assert int(split.train_lengths.sum()) == 1000209 - 2 * 6040


def test_ml1m_shared_table_is_data_a_model_serves() -> None:
    """Its users are the integers a request names, and its timed users' times are unix seconds
    a request can carry, in ``seq_pos``'s order: what training and serving check
    (data.servable) refuses none of it; nor of the original ``ratings.dat`` users and ML-100K,
    every user timed."""
    ordered = load_sequences("ml-1m", ML1M)
    check_user_ids(ordered.source, ordered.user_ids)
    check_times(ordered)
    for seqs in (load_sequences("ratings-dat", ML1M / "ratings_users_1-2999.dat.gz"),
                 load_sequences("ml-100k", ML100K)):
        assert seqs.all_timed
        check_user_ids(seqs.source, seqs.user_ids)
        check_times(seqs)
        assert int(seqs.timestamps.min()) > 0 and int(seqs.timestamps.max()) < 2 ** 31


def test_ml1m_ratings_dat_in_another_file_order_is_the_same_rows_in_other_sequences() -> None:
    """``ratings.dat`` gives many users' last two events one timestamp, and events of one
    timestamp keep file order: its rows shuffled are the same table, and other sequences with
    other held-out items, which the sequences' fingerprint tells apart."""
    table = resolve("ratings-dat", ML1M / "ratings_users_1-2999.dat.gz").read()
    seqs = build_sequences(table)
    ends = seqs.offsets[1:]
    assert int((seqs.timestamps[ends - 1] == seqs.timestamps[ends - 2]).sum()) == 1268
    perm = np.random.default_rng(0).permutation(table.num_rows)
    assert table.timestamps is not None and table.has_timestamp is not None
    shuffled = build_sequences(replace(table, users=table.users[perm], items=table.items[perm],
                                       timestamps=table.timestamps[perm],
                                       has_timestamp=table.has_timestamp[perm],
                                       lines=table.lines[perm]), seqs.id_map)
    assert shuffled.fingerprint == seqs.fingerprint
    assert shuffled.sequence_fingerprint != seqs.sequence_fingerprint
    assert (leave_one_out(shuffled).test.targets != leave_one_out(seqs).test.targets).any()
