"""Channels of retrieval merged into one list (``InterleavedRetrieval``): each channel holds its
share of every prefix, no item twice, a channel that runs out yields its places, and the
merged scores are reciprocal ranks. Exact lists, worked out by hand from the rule (position p
goes to the channel furthest below its share of p + 1, ties to the earlier one)."""

from __future__ import annotations

import numpy as np
import pytest

from relaygr.cascade.proposals import InterleavedRetrieval
from relaygr.cascade.stages import EarlierStages
from relaygr.errors import ConfigError, EmptyInputError


class Listed:
    """A channel that proposes a fixed list (minus ``exclude``), scores falling."""

    def __init__(self, name: str, ids: list[int]) -> None:
        self.name, self.ids = name, ids
        self.excluded: list[np.ndarray | None] = []

    def propose(self, history: np.ndarray, k: int, user_id: int | None = None) -> np.ndarray:
        return self.scored(history, k, user_id)[0]

    def scored(self, history: np.ndarray, k: int, user_id: int | None = None,
               exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        self.excluded.append(exclude)
        ids = [i for i in self.ids if exclude is None or i not in exclude][:k]
        return np.asarray(ids, dtype=np.int64), -np.arange(len(ids), dtype=np.float32)


HISTORY = np.array([7, 8], dtype=np.int64)


def _merge(channels: list[tuple[list[int], float]], k: int,
           exclude: np.ndarray | None = None) -> list[int]:
    stage = InterleavedRetrieval([(Listed(f"c{i}", ids), share)
                                  for i, (ids, share) in enumerate(channels)])
    ids, scores = stage.scored(HISTORY, k, exclude=exclude)
    assert scores.dtype == np.float32
    np.testing.assert_array_equal(scores, 1 / np.arange(1, len(ids) + 1, dtype=np.float32))
    return ids.tolist()


def test_equal_shares_alternate_and_a_channel_that_runs_out_yields_its_places() -> None:
    assert _merge([([1, 2, 3, 4, 5, 6], 0.5), ([10, 11, 12, 13], 0.5)], 20) == \
        [1, 10, 2, 11, 3, 12, 4, 13, 5, 6]
    assert _merge([([1, 2, 3, 4, 5, 6], 0.5), ([10, 11, 12, 13], 0.5)], 5) == [1, 10, 2, 11, 3]


def test_every_prefix_holds_each_channels_share() -> None:
    # 3/4 and 1/4: A A B A A A B A (deficits worked by hand; ties to the earlier channel)
    assert _merge([(list(range(1, 9)), 0.75), ([10, 11, 12, 13], 0.25)], 8) == \
        [1, 2, 10, 3, 4, 5, 11, 6]
    shares = [0.5, 0.3, 0.2]
    channels = [(list(range(100 * c, 100 * c + 60)), s) for c, s in enumerate(shares)]
    merged = _merge(channels, 100)
    for n in range(1, 101):
        held = np.bincount(np.asarray(merged[:n]) // 100, minlength=3)
        assert (np.abs(held - np.asarray(shares) * n) < 1).all(), (n, held)


def test_an_item_proposed_twice_is_kept_once_at_its_first_place() -> None:
    # p0 A:1, p1 B:2, p2 A: 2 taken -> 3, p3 B:4, p4 A has none left -> B: 1 taken -> 5
    assert _merge([([1, 2, 3], 0.5), ([2, 4, 1, 5], 0.5)], 10) == [1, 2, 3, 4, 5]


def test_exclude_and_the_users_events_reach_every_channel() -> None:
    a, b = Listed("a", [1, 2, 3, 7]), Listed("b", [3, 4, 8, 5])
    stage = InterleavedRetrieval([(a, 0.5), (b, 0.5)])
    ids, _ = stage.scored(HISTORY, 4, exclude=np.array([3], dtype=np.int64))
    assert ids.tolist() == [1, 4, 2, 5]                   # 7 and 8 are the user's events
    assert [e.tolist() for e in a.excluded + b.excluded if e is not None] == [[3, 7, 8]] * 2
    assert stage.name == "a (50%) + b (50%)"
    assert stage.propose(HISTORY, 2).tolist() == [1, 3]
    assert not stage.order(4).flags.writeable            # the cached order is shared


@pytest.mark.parametrize("shares", [[1.0], [0.5, 0.6], [0.0, 1.0], [1.2, -0.2]])
def test_shares_that_are_not_a_split_of_the_list_are_refused(shares: list[float]) -> None:
    with pytest.raises(ConfigError, match="shares in"):
        InterleavedRetrieval([(Listed(f"c{i}", [1]), s) for i, s in enumerate(shares)])


def test_the_shares_hold_among_the_candidates_pre_processing_keeps() -> None:
    """A channel whose best items are the user's own events (the item embeddings' mean sits
    among them) keeps its share of the candidates: the events are left out of every channel's
    search, not dropped after the merge."""
    history = np.arange(100, 140, dtype=np.int64)
    near = Listed("near", [*history.tolist(), *range(1, 61)])         # seen items first
    far = Listed("far", list(range(200, 260)))
    stages = EarlierStages(InterleavedRetrieval([(near, 0.5), (far, 0.5)]), 64, 0.0, 0.0)
    try:
        kept, scores = stages.candidates(history, 32)
    finally:
        stages.shutdown()
    assert kept.tolist() == [x for pair in zip(range(1, 17), range(200, 216), strict=True)
                             for x in pair]
    assert scores.tolist() == pytest.approx((1 / np.arange(1, 33)).tolist())
    assert [e.tolist() for e in near.excluded if e is not None] == [history.tolist()]


class Refusing(Listed):
    """A channel that knows none of the user's events (a run that never saw those items)."""

    def scored(self, history: np.ndarray, k: int, user_id: int | None = None,
               exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        raise EmptyInputError(f"none of the user's {len(history)} events is an item of {self.name}")


def test_a_channel_that_cannot_read_the_user_yields_the_list_to_the_others() -> None:
    stage = InterleavedRetrieval([(Listed("a", [1, 2, 3]), 0.5), (Refusing("run", []), 0.5)])
    assert stage.propose(HISTORY, 5).tolist() == [1, 2, 3]
    both = InterleavedRetrieval([(Refusing("a", []), 0.5), (Refusing("run", []), 0.5)])
    with pytest.raises(EmptyInputError, match="item of"):
        both.propose(HISTORY, 5)
    with pytest.raises(EmptyInputError, match="at least one event"):
        stage.propose(np.array([], dtype=np.int64), 5)
