"""The loaders on the shared MovieLens files (skipped when ../shared/datasets is absent)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relaygr.data import leave_one_out, load_sequences

DATASETS = Path(__file__).resolve().parents[2].parent / "shared" / "datasets"
ML1M = DATASETS / "ml-1m"
pytestmark = pytest.mark.skipif(not ML1M.is_dir(), reason="shared datasets not present")


def test_ml1m_shared_table_and_original_ratings_dat_agree() -> None:
    ordered = load_sequences("ml-1m", ML1M)
    assert (ordered.num_users, ordered.num_items, ordered.num_events) == (6040, 3706, 1000209)
    # users 3000-6040 have no timestamps in the shared table
    assert ordered.timed.tolist() == [u < 3000 for u in ordered.user_ids.tolist()]
    original = load_sequences("ratings-dat", ML1M / "ratings_users_1-2999.dat.gz")
    assert (original.num_users, original.num_events) == (2999, 487650)
    assert original.all_timed
    for user in range(original.num_users):
        a, b = ordered.history(user), original.history(user)
        assert a.user_id == b.user_id == user + 1
        # same events, same timestamps in the same order (ties among equal times may differ)
        assert a.timestamps is not None and b.timestamps is not None
        assert np.array_equal(a.timestamps, b.timestamps)
        assert sorted(a.original_items.tolist()) == sorted(b.original_items.tolist())
    split = leave_one_out(ordered)
    assert len(split.test) == len(split.valid) == 6040
    assert int(split.train_lengths.sum()) == 1000209 - 2 * 6040
