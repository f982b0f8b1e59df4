"""History store: exact contents, immutable snapshots, prefix versions, typed errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.cascade.store import (
    InMemoryHistoryStore,
    SyntheticHistories,
    generate_histories,
)
from relaygr.errors import (
    ConfigError,
    EmptyInputError,
    HistoryConflictError,
    InvalidInputError,
    ItemOutOfRangeError,
    TimestampError,
    UnknownUserError,
)


def test_append_and_get_hold_exactly_the_events() -> None:
    store = InMemoryHistoryStore(num_items=100)
    first = store.append(7, [3, 1, 4], [10, 10, 12])
    assert first.timestamps is not None
    assert first.items.tolist() == [3, 1, 4] and first.timestamps.tolist() == [10, 10, 12]
    store.append(7, np.array([1, 5]), np.array([12, 20]))
    got = store.get(7)
    assert got.user_id == 7 and got.num_events == 5
    assert got.items.dtype == np.int64 and got.items.tolist() == [3, 1, 4, 1, 5]
    assert got.timestamps.tolist() == [10, 10, 12, 12, 20]  # type: ignore[union-attr]
    assert got.version == store.version_at(7, 5)
    head = store.prefix(7, 2)
    assert head.items.tolist() == [3, 1] and head.version == store.version_at(7, 2)
    assert store.num_events(7) == 5 and 7 in store and 8 not in store and len(store) == 1
    # The first snapshot still shows three events, and nobody can write into it.
    assert first.items.tolist() == [3, 1, 4]
    with pytest.raises(ValueError):
        got.items[0] = 9


def test_snapshots_survive_buffer_growth() -> None:
    store = InMemoryHistoryStore()
    snaps = [store.append(1, [1 + i % 50]) for i in range(100)]
    for length, snap in enumerate(snaps, start=1):
        assert snap.items.tolist() == [1 + i % 50 for i in range(length)]
        assert snap.version == store.version_at(1, length)
        assert snap.timestamps is None


@settings(max_examples=50, deadline=None)
@given(events=st.lists(st.tuples(st.integers(1, 1000), st.integers(0, 50)), min_size=1,
                       max_size=60),
       cuts=st.lists(st.integers(1, 59), max_size=5))
def test_versions_depend_only_on_the_events_and_never_change_when_appending(
        events: list[tuple[int, int]], cuts: list[int]) -> None:
    items = np.array([e[0] for e in events])
    ts = np.cumsum([e[1] for e in events])
    whole = InMemoryHistoryStore()
    whole.append(1, items, ts)
    chunked = InMemoryHistoryStore()
    bounds = sorted({c for c in cuts if c < len(events)} | {0, len(events)})
    seen: dict[int, int] = {}
    for lo, hi in itertools.pairwise(bounds):
        chunked.append(1, items[lo:hi], ts[lo:hi])
        for n in range(hi + 1):
            version = chunked.version_at(1, n)
            assert seen.setdefault(n, version) == version      # appends never change it
    versions = [whole.version_at(1, n) for n in range(len(events) + 1)]
    assert versions == [seen[n] for n in range(len(events) + 1)]
    assert len(set(versions)) == len(versions)                  # every growth changes it


def test_a_changed_event_changes_the_versions_of_prefixes_that_include_it() -> None:
    a = InMemoryHistoryStore.from_sequences({1: ([5, 6, 7, 8], [1, 2, 3, 4])})
    b = InMemoryHistoryStore.from_sequences({1: ([5, 6, 9, 8], [1, 2, 3, 4])})
    c = InMemoryHistoryStore.from_sequences({1: ([5, 6, 7, 8], [1, 2, 3, 5])})
    d = InMemoryHistoryStore.from_sequences({1: ([6, 5, 7, 8], [1, 2, 3, 4])})
    untimed = InMemoryHistoryStore.from_sequences({1: ([5, 6, 7, 8], None)})
    for n in range(5):
        assert (a.version_at(1, n) == b.version_at(1, n)) == (n <= 2)
        assert (a.version_at(1, n) == c.version_at(1, n)) == (n <= 3)
        assert (a.version_at(1, n) == d.version_at(1, n)) == (n == 0)
        assert a.version_at(1, n) != untimed.version_at(1, n)


def test_bad_input_is_a_typed_error_and_changes_nothing() -> None:
    store = InMemoryHistoryStore(num_items=10)
    store.append(1, [1, 2], [100, 200])
    store.append(2, [3])
    before = (store.get(1), store.get(2), len(store))
    bad_calls = [
        (UnknownUserError, lambda: store.get(3)),
        (UnknownUserError, lambda: store.version_at(3, 0)),
        (InvalidInputError, lambda: store.get(-1)),
        (InvalidInputError, lambda: store.append(True, [1])),
        (ItemOutOfRangeError, lambda: store.append(1, [0], [300])),
        (ItemOutOfRangeError, lambda: store.append(3, [11])),
        (InvalidInputError, lambda: store.append(3, [1.5])),
        (InvalidInputError, lambda: store.append(3, [[1]])),
        (EmptyInputError, lambda: store.append(3, [])),
        (TimestampError, lambda: store.append(1, [1])),
        (TimestampError, lambda: store.append(2, [1], [5])),
        (TimestampError, lambda: store.append(1, [1, 2], [300])),
        (TimestampError, lambda: store.append(1, [1], [150])),
        (TimestampError, lambda: store.append(3, [1, 2], [5, 4])),
        (TimestampError, lambda: store.append(1, [1], [2 ** 62])),        # past what ranks
        (InvalidInputError, lambda: store.append(2 ** 53, [1])),         # past the API's ids
        (InvalidInputError, lambda: store.version_at(1, 3)),
        (InvalidInputError, lambda: store.prefix(1, -1)),
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            call()
    after = (store.get(1), store.get(2), len(store))
    assert before[2] == after[2] == 2 and 3 not in store
    for old, new in zip(before[:2], after[:2], strict=True):
        assert old.version == new.version and old.items.tolist() == new.items.tolist()


def test_an_append_whose_expected_count_is_not_the_users_changes_nothing() -> None:
    """``expected_events`` (the count the caller believes precedes its append) is checked with
    the append, before its timestamps: a retry of an append that landed is a conflict naming
    the count, not a time-order error, and the events are held once."""
    store = InMemoryHistoryStore(num_items=100)
    store.append(7, [3, 1], [10, 11], expected_events=0)
    store.append(7, [4, 1], [12, 13], expected_events=2)
    before = store.get(7)
    with pytest.raises(HistoryConflictError, match="user 7 has 4 events, not the 2") as caught:
        store.append(7, [4, 1], [12, 13], expected_events=2)
    assert (caught.value.num_events, caught.value.expected_events) == (4, 2)
    with pytest.raises(HistoryConflictError, match="user 8 has 0 events, not the 1"):
        store.append(8, [4], [12], expected_events=1)
    with pytest.raises(InvalidInputError, match="expected_events"):
        store.append(7, [5], [14], expected_events=-1)
    assert store.get(7).items.tolist() == [3, 1, 4, 1] and store.get(7).version == before.version
    assert 8 not in store


def test_synthetic_histories_are_seeded_bounded_and_popularity_skewed() -> None:
    config = SyntheticHistories(num_users=200, num_items=500, min_events=8, max_events=64,
                                zipf_exponent=1.0, seed=4)
    store = InMemoryHistoryStore.synthetic(config)
    assert list(store) == list(range(1, 201)) and store.num_items == 500
    again = generate_histories(config)
    other = generate_histories(SyntheticHistories(num_users=200, num_items=500, min_events=8,
                                                  max_events=64, seed=5))
    lengths, all_items = [], []
    for user in store:
        history = store.get(user)
        assert np.array_equal(history.items, again[user][0])
        assert 8 <= history.num_events <= 64
        assert history.timestamps is not None
        assert np.all(np.diff(history.timestamps) >= 0)
        lengths.append(history.num_events)
        all_items.append(history.items)
    assert any(not np.array_equal(again[u][0], other[u][0]) for u in again)
    assert min(lengths) < 16 and max(lengths) > 40
    counts = np.bincount(np.concatenate(all_items), minlength=501)[1:]
    assert counts.min() >= 0 and counts.max() > 20 * max(1, int(np.median(counts)))
    untimed = generate_histories(SyntheticHistories(num_users=3, num_items=5, timed=False))
    assert all(ts is None for _, ts in untimed.values())
    with pytest.raises(ConfigError, match="unknown"):
        SyntheticHistories.from_dict({"num_users": 1, "num_items": 1, "users": 2})
    with pytest.raises(ConfigError):
        SyntheticHistories(num_users=1, num_items=1, min_events=5, max_events=4)


def test_version_after_predicts_the_version_of_an_append() -> None:
    store = InMemoryHistoryStore.from_sequences(
        {7: ([3, 1, 4], [10, 20, 30]), 8: ([5, 9], None)}, num_items=20)
    predicted = store.version_after(7, 3, [1, 5], [40, 50])
    untimed = store.version_after(8, 2, [2])
    assert store.version_after(7, 3, []) == store.version_at(7, 3)
    before = store.get(7)
    assert store.get(7).version == before.version          # nothing changed
    store.append(7, [1, 5], [40, 50])
    store.append(8, [2])
    assert store.version_at(7, 5) == predicted
    assert store.version_at(8, 3) == untimed
    # from an earlier cut: the version of events 0..1 followed by (9, 35)
    other = InMemoryHistoryStore.from_sequences({7: ([3, 1, 9], [10, 20, 35])}, num_items=20)
    assert store.version_after(7, 2, [9], [35]) == other.version_at(7, 3)
    with pytest.raises(TimestampError):
        store.version_after(7, 2, [9])
    with pytest.raises(TimestampError):
        store.version_after(8, 2, [9], [1])
