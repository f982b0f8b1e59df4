"""Ordering rules, dense ids, the saved id map, and the leave-one-out split, on exact cases."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.data import (
    IdMap,
    InteractionTable,
    build_sequences,
    hold_out_validation_of,
    iter_histories,
    leave_one_out,
    load_sequences,
)
from relaygr.errors import CheckpointError, ConfigError, DataFormatError


def _table(users: Sequence[object], items: Sequence[object], stamps: list[int | None] | None = None,
           order: list[int] | None = None) -> InteractionTable:
    n = len(users)
    ts = has = None
    if stamps is not None:
        has = np.array([s is not None for s in stamps])
        ts = np.array([0 if s is None else s for s in stamps], dtype=np.int64)
    return InteractionTable(
        source="mem.csv", users=np.array(users), items=np.array(items), timestamps=ts,
        has_timestamp=has, order=None if order is None else np.array(order, dtype=np.int64),
        lines=np.arange(2, n + 2))


def test_timestamp_order_is_stable_and_ids_are_dense_sorted() -> None:
    seqs = build_sequences(_table([7, 3, 7, 7, 3], [50, 20, 10, 40, 50],
                                  [300, 5, 100, 100, 1]))
    assert seqs.id_map.items == (10, 20, 40, 50)
    assert seqs.user_ids.tolist() == [3, 7]
    # user 3: ts 1 (item 50) then ts 5 (item 20); user 7: ts 100 ties keep file order (10, 40)
    assert seqs.sequence(0).tolist() == [4, 2]
    assert seqs.sequence(1).tolist() == [1, 3, 4]
    assert seqs.times(1) is not None and seqs.times(1).tolist() == [100, 100, 300]  # type: ignore[union-attr]
    assert seqs.timed.tolist() == [True, True]
    history = seqs.history(1)
    assert history.user_id == 7 and history.original_items.tolist() == [10, 40, 50]


def test_order_column_wins_and_untimed_users_have_no_times() -> None:
    seqs = build_sequences(_table(["u", "u", "v", "v"], ["a", "b", "c", "a"],
                                  [10, 20, None, None], order=[1, 0, 0, 1]))
    assert seqs.sequence(0).tolist() == [2, 1]      # u: order 0 is b, order 1 is a
    assert seqs.sequence(1).tolist() == [3, 1]
    assert seqs.timed.tolist() == [True, False]
    assert seqs.times(1) is None and not seqs.all_timed
    assert seqs.times(0).tolist() == [20, 10]  # type: ignore[union-attr]


def test_partly_timed_user_without_order_keeps_file_order() -> None:
    seqs = build_sequences(_table([1, 1, 1], [9, 8, 7], [30, None, 10]))
    assert seqs.sequence(0).tolist() == [3, 2, 1] and seqs.times(0) is None


def test_repeated_order_value_is_an_error_at_its_line() -> None:
    with pytest.raises(DataFormatError, match="order value 0 repeats") as info:
        build_sequences(_table([1, 2, 1], [5, 6, 7], order=[0, 0, 0]))
    assert info.value.line == 4


def test_id_map_save_load_and_unknown_items(tmp_path: Path) -> None:
    seqs = build_sequences(_table([1, 1, 2], [30, 10, 20], [1, 2, 3]))
    seqs.id_map.save(tmp_path / "id_map.json")
    loaded = IdMap.load(tmp_path / "id_map.json")
    assert loaded == seqs.id_map and loaded.items == (10, 20, 30)
    other = _table([4, 4, 4], [20, 99, 30], [1, 2, 3])
    with pytest.raises(DataFormatError, match="item 99 is not in the id map") as info:
        build_sequences(other, loaded)
    assert info.value.line == 3
    kept = build_sequences(other, loaded, drop_unknown_items=True)
    assert kept.sequence(0).tolist() == [2, 3] and kept.num_items == 3
    (tmp_path / "bad.json").write_text('{"format": "x"}')
    with pytest.raises(CheckpointError):
        IdMap.load(tmp_path / "bad.json")


def test_string_ids_map_through_the_dict_path() -> None:
    id_map = IdMap(("a", "b"))
    assert id_map.dense_ids(np.array(["b", "z", "a"], dtype=object)).tolist() == [2, 0, 1]
    assert id_map.dense_ids(np.array([1, 2])).tolist() == [0, 0]


def test_leave_one_out_split_is_exact() -> None:
    # user 0: 5 events, user 1: 2 events (train only), user 2: 3 events
    seqs = build_sequences(_table([0] * 5 + [1] * 2 + [2] * 3,
                                  [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], list(range(10))))
    split = leave_one_out(seqs)
    assert split.train_lengths.tolist() == [3, 2, 1]
    assert split.valid.users.tolist() == [0, 2] and split.test.users.tolist() == [0, 2]
    assert split.valid.history_lengths.tolist() == [3, 1]
    assert split.valid.targets.tolist() == [4, 9]
    assert split.test.history_lengths.tolist() == [4, 2]
    assert split.test.targets.tolist() == [5, 10]


def test_holding_out_only_some_validation_items_trains_the_rest() -> None:
    # users 0, 2, 3 are evaluated (>= 3 events); user 1 has 2 events and only trains
    seqs = build_sequences(_table([0] * 5 + [1] * 2 + [2] * 3 + [3] * 4,
                                  list(range(1, 15)), list(range(14))))
    base = leave_one_out(seqs)
    split = hold_out_validation_of(base, 1, seed=3)
    held = split.valid.users.tolist()
    assert len(held) == 1 and held[0] in (0, 2, 3)
    for user in (0, 2, 3):   # all but the test item trains, except for the held-out user
        expected = base.train_lengths[user] + (0 if user == held[0] else 1)
        assert split.train_lengths[user] == expected
        assert split.train_lengths[user] < seqs.lengths[user]   # the test item never trains
    assert split.train_lengths[1] == 2
    j = base.valid.users.tolist().index(held[0])
    assert split.valid.targets.tolist() == [base.valid.targets[j]]
    assert split.test == base.test
    assert hold_out_validation_of(base, 1, seed=3).valid.users.tolist() == held  # seeded
    with pytest.raises(ConfigError):
        hold_out_validation_of(base, 4, seed=0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 9), st.integers(0, 20)),
                min_size=1, max_size=40))
def test_sequences_keep_every_event_in_time_order(rows: list[tuple[int, int, int]]) -> None:
    users, items, stamps = (list(c) for c in zip(*rows, strict=True))
    seqs = build_sequences(_table(users, items, stamps))
    assert seqs.num_events == len(rows)
    for u, user in enumerate(seqs.user_ids):
        mine = [(t, i) for uu, i, t in rows if uu == user]
        originals = seqs.id_map.original_ids(seqs.sequence(u)).tolist()
        # stable sort of the user's rows by time gives exactly the built sequence
        expected = [i for _, i in sorted(mine, key=lambda pair: pair[0])]
        assert originals == expected
        times = seqs.times(u)
        assert times is not None and (np.diff(times) >= 0).all()


def test_iter_histories_from_a_directory(tmp_path: Path) -> None:
    (tmp_path / "u.data").write_text("2\t5\t3\t20\n2\t6\t3\t10\n1\t5\t4\t1\n")
    histories = list(iter_histories("ml-100k", tmp_path))
    assert [h.user_id for h in histories] == [1, 2]
    assert histories[1].original_items.tolist() == [6, 5]
    assert histories[1].items.tolist() == [2, 1]
    assert histories[1].timestamps is not None and histories[1].timestamps.tolist() == [10, 20]
    seqs = load_sequences("ml-100k", tmp_path / "u.data")
    assert seqs.num_users == 2 and seqs.num_items == 2
