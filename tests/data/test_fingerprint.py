"""A table's fingerprint is its rows': the same rows in any order give the same one; another user,
item, timestamp or order value, or a row repeated another number of times, gives another.

Its sequences' fingerprint is each user's events in its order: the same rows in a file order
that orders a user's events otherwise (events of one timestamp, or without timestamps, keep
file order) give another, however the users' rows interleave in the file and whatever the id
map."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from relaygr.data import IdMap, InteractionTable, build_sequences, table_fingerprint


def _table(users: list, items: list, stamps: list[int | None] | None = None,
           order: list[int] | None = None) -> InteractionTable:
    n = len(users)
    timestamps = has = None
    if stamps is not None:
        has = np.array([s is not None for s in stamps])
        timestamps = np.array([s or 0 for s in stamps], dtype=np.int64)
    kind = np.int64 if isinstance(users[0], int) else object
    return InteractionTable(
        source="t.csv", users=np.array(users, dtype=kind),
        items=np.array(items, dtype=np.int64 if isinstance(items[0], int) else object),
        timestamps=timestamps, has_timestamp=has,
        order=None if order is None else np.array(order, dtype=np.int64),
        lines=np.arange(2, n + 2, dtype=np.int64))


def _shuffled(table: InteractionTable, seed: int) -> InteractionTable:
    perm = np.random.default_rng(seed).permutation(table.num_rows)

    def pick(column: np.ndarray | None) -> np.ndarray | None:
        return None if column is None else column[perm]

    return replace(table, users=table.users[perm], items=table.items[perm],
                   timestamps=pick(table.timestamps), has_timestamp=pick(table.has_timestamp),
                   order=pick(table.order), source="elsewhere.csv")


TIMED = _table([1, 1, 2, 2, 3], [10, 11, 10, 12, 11], [100, 101, 100, None, 105])


def test_the_construction_is_fixed() -> None:
    # a run records this value: a change to the construction would refuse every recorded run's
    # data, so it is pinned here
    assert table_fingerprint(TIMED) == "704c72a58ef44bc27d92764d695a7b4a"


@pytest.mark.parametrize("table", [
    TIMED,
    _table([1, 1, 2, 2, 3], [10, 11, 10, 12, 11]),
    _table([1, 1, 2, 2, 3], [10, 11, 10, 12, 11], order=[0, 1, 0, 1, 0]),
    _table(["a", "a", "b", "b", "c"], ["x", "y", "x", "z", "y"], [1, 2, 3, 4, 5]),
])
def test_the_same_rows_in_another_order_are_the_same_data(table: InteractionTable) -> None:
    for seed in range(5):
        assert table_fingerprint(_shuffled(table, seed)) == table_fingerprint(table)


@pytest.mark.parametrize("other", [
    # users 1 and 2 swapped: the same counts, other users' histories
    _table([2, 2, 1, 1, 3], [10, 11, 10, 12, 11], [100, 101, 100, None, 105]),
    # one item changed to another the table holds: the same distinct items
    _table([1, 1, 2, 2, 3], [10, 11, 10, 12, 12], [100, 101, 100, None, 105]),
    # one timestamp moved, one gained
    _table([1, 1, 2, 2, 3], [10, 11, 10, 12, 11], [100, 102, 100, None, 105]),
    _table([1, 1, 2, 2, 3], [10, 11, 10, 12, 11], [100, 101, 100, 0, 105]),
    # the same ids and times without the time column, or with an order column
    _table([1, 1, 2, 2, 3], [10, 11, 10, 12, 11]),
    _table([1, 1, 2, 2, 3], [10, 11, 10, 12, 11], [100, 101, 100, None, 105],
           order=[0, 1, 0, 1, 0]),
    # the same ids as strings
    _table(["1", "1", "2", "2", "3"], ["10", "11", "10", "12", "11"],
           [100, 101, 100, None, 105]),
])
def test_other_rows_are_other_data(other: InteractionTable) -> None:
    assert table_fingerprint(other) != table_fingerprint(TIMED)


def test_a_repeated_row_counts_each_time() -> None:
    # xor would cancel each pair: both tables would read as empty
    twice = _table([1, 1, 2, 2], [10, 10, 11, 11])
    other = _table([1, 1, 2, 2], [11, 11, 10, 10])
    assert table_fingerprint(twice) != table_fingerprint(other)
    assert table_fingerprint(twice) != table_fingerprint(_table([1, 1, 2, 2], [10, 11, 10, 11]))


def test_sequences_carry_the_fingerprint_of_the_table_as_read() -> None:
    seqs = build_sequences(TIMED)
    assert seqs.fingerprint == table_fingerprint(TIMED)
    # read with a model's id map that knows item 10 alone: the other rows are dropped, the
    # record is still the file's
    known = build_sequences(TIMED, build_sequences(_table([1], [10])).id_map,
                            drop_unknown_items=True)
    assert known.num_events == 2 and known.fingerprint == table_fingerprint(TIMED)


def _rows(table: InteractionTable, rows: list[int]) -> InteractionTable:
    """``table``'s rows in the order ``rows`` lists them."""
    def pick(column: np.ndarray | None) -> np.ndarray | None:
        return None if column is None else column[rows]

    return replace(table, users=table.users[rows], items=table.items[rows],
                   timestamps=pick(table.timestamps), has_timestamp=pick(table.has_timestamp),
                   order=pick(table.order))


# user 1's items 10 and 11 tie at 100, in this file order; user 2 is untimed (file order)
TIED = _table([1, 2, 1, 1, 2], [10, 10, 11, 12, 12], [100, 100, 100, 101, None])


def test_the_sequence_construction_is_fixed() -> None:
    # a run records this value too: pinned as the table's is
    assert build_sequences(TIED).sequence_fingerprint == "fc42366949e4940efefd224836d90790"


@pytest.mark.parametrize(("table", "rows"), [
    (TIED, [2, 1, 0, 3, 4]),                  # user 1's tied events in the other file order
    (TIED, [0, 4, 2, 3, 1]),                  # user 2's untimed events in the other order
    (_table([1, 1, 2], [10, 11, 10]), [1, 0, 2]),     # no time column: file order
])
def test_the_same_rows_ordering_a_user_otherwise_are_other_sequences(
        table: InteractionTable, rows: list[int]) -> None:
    reordered = _rows(table, rows)
    assert table_fingerprint(reordered) == table_fingerprint(table)
    seqs, other = build_sequences(table), build_sequences(reordered)
    assert not np.array_equal(seqs.items, other.items)
    assert other.sequence_fingerprint != seqs.sequence_fingerprint


def test_users_interleaved_otherwise_or_another_id_map_are_the_same_sequences() -> None:
    seqs = build_sequences(TIED)
    # each user's rows in their file order, the users' rows no longer interleaved
    assert build_sequences(_rows(TIED, [0, 2, 3, 1, 4])).sequence_fingerprint == \
        seqs.sequence_fingerprint
    # every user timed at distinct times: any file order gives the same sequences
    timed = _table([1, 1, 2, 2, 3], [10, 11, 10, 12, 11], [100, 101, 100, 102, 105])
    for seed in range(5):
        assert build_sequences(_shuffled(timed, seed)).sequence_fingerprint == \
            build_sequences(timed).sequence_fingerprint
    # read with another id map (the dense ids in the other order, and one more item): the
    # model's ids differ, the sequences' items do not
    other_map = IdMap((99, *reversed(seqs.id_map.items)))
    mapped = build_sequences(TIED, other_map)
    assert not np.array_equal(mapped.items, seqs.items)
    assert mapped.sequence_fingerprint == seqs.sequence_fingerprint
    named = _table(["a", "b", "a", "a", "b"], ["x", "x", "y", "z", "z"],
                   [100, 100, 100, 101, None])
    assert build_sequences(named, IdMap(("z", "y", "x"))).sequence_fingerprint == \
        build_sequences(named).sequence_fingerprint


@pytest.mark.parametrize("other", [
    # users 1 and 2 swapped
    _table([2, 1, 2, 2, 1], [10, 10, 11, 12, 12], [100, 100, 100, 101, None]),
    # one item changed to another the table holds
    _table([1, 2, 1, 1, 2], [10, 10, 11, 11, 12], [100, 100, 100, 101, None]),
    # a timed user's time moved; the untimed user's gained (it is timed then)
    _table([1, 2, 1, 1, 2], [10, 10, 11, 12, 12], [100, 100, 100, 102, None]),
    _table([1, 2, 1, 1, 2], [10, 10, 11, 12, 12], [100, 100, 100, 101, 100]),
    # the same ids as strings
    _table(["1", "2", "1", "1", "2"], ["10", "10", "11", "12", "12"],
           [100, 100, 100, 101, None]),
])
def test_other_sequences_give_another_fingerprint(other: InteractionTable) -> None:
    assert build_sequences(other).sequence_fingerprint != \
        build_sequences(TIED).sequence_fingerprint
