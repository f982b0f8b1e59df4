"""Time-ordered user sequences with dense item ids, built from an ``InteractionTable``.

Ordering rule, per user: by the table's order column when it has one (a repeated position is an
error); otherwise by timestamp when every event of the user has one (ties keep file order, as a
stable sort of ``ratings.dat`` does); otherwise in file order. A user is *timed* when every one of
its events has a timestamp; the model then may use time, and must not otherwise. Ordered by the
order column, a timed user's timestamps may go back: the sequences keep them as they are, and a
model that reads time refuses them (``servable.check_time_order``).

Item ids are remapped densely: the ``IdMap`` lists original ids in sorted order and dense id
``i + 1`` is ``IdMap.items[i]`` (0 stays the model's padding). The same data therefore always
gives the same mapping, and a mapping saved with a model turns new logs into its ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from relaygr.data.fingerprint import sequence_fingerprint, table_fingerprint
from relaygr.data.table import InteractionTable
from relaygr.errors import CheckpointError, DataFormatError

_ID_MAP_FORMAT = "relaygr-id-map/1"
OriginalId = int | str


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    return np.unique(values)  # numeric order for int64, lexicographic for str


@dataclass(frozen=True)
class IdMap:
    """Original item id ↔ dense id. ``items[i]`` is the original id of dense id ``i + 1``.

    Invariant: ``items`` holds distinct ids of one kind (all int or all str).
    """

    items: tuple[OriginalId, ...]

    def __post_init__(self) -> None:
        if len(set(self.items)) != len(self.items):
            raise CheckpointError("id map lists an item id twice")
        if len({type(i) for i in self.items}) > 1:
            raise CheckpointError("id map mixes int and str item ids")

    @property
    def num_items(self) -> int:
        return len(self.items)

    @cached_property
    def _int_keys(self) -> np.ndarray | None:
        """The ids as a sorted int64 array when they are ints in sorted order (fast lookup)."""
        if not self.items or not isinstance(self.items[0], int):
            return None
        keys = np.asarray(self.items, dtype=np.int64)
        return keys if bool((np.diff(keys) > 0).all()) else None

    @cached_property
    def _dense(self) -> dict[OriginalId, int]:
        return {original: dense for dense, original in enumerate(self.items, 1)}

    def dense_ids(self, originals: np.ndarray) -> np.ndarray:
        """Dense ids of ``originals``; 0 where an id is not in the map."""
        keys = self._int_keys
        if keys is not None and np.asarray(originals).dtype.kind in "iu":
            values = np.asarray(originals, dtype=np.int64)
            where = np.searchsorted(keys, values).clip(max=len(keys) - 1)
            return np.where(keys[where] == values, where + 1, 0).astype(np.int64)
        lookup = self._dense
        return np.fromiter((lookup.get(_plain(o), 0) for o in originals), dtype=np.int64,
                           count=len(originals))

    def original_ids(self, dense: np.ndarray) -> np.ndarray:
        """Original ids of dense ids ``1..num_items``."""
        table = np.asarray(self.items, dtype=object)
        return table[np.asarray(dense, dtype=np.int64) - 1]

    @classmethod
    def fit(cls, originals: np.ndarray) -> IdMap:
        """The map of every distinct id in ``originals``, in sorted order."""
        return cls(tuple(_plain(o) for o in _sorted_unique(originals)))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"format": _ID_MAP_FORMAT, "items": list(self.items)}))

    @classmethod
    def load(cls, path: Path) -> IdMap:
        try:
            data: dict[str, Any] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read id map {path}: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != _ID_MAP_FORMAT \
                or not isinstance(data.get("items"), list) \
                or not all(isinstance(i, (int, str)) and not isinstance(i, bool)
                           for i in data["items"]):
            raise CheckpointError(f"{path} is not a relaygr id map ({_ID_MAP_FORMAT}: a list "
                                  "of original item ids, integers or strings)")
        return cls(tuple(data["items"]))


def _plain(value: Any) -> OriginalId:
    """A numpy scalar as a plain Python int or str (JSON- and dict-friendly)."""
    return int(value) if isinstance(value, (int, np.integer)) else str(value)


@dataclass(frozen=True)
class UserEvents:
    """One user's whole history in time order: dense ids (model input) and original ids."""

    user_id: OriginalId
    items: np.ndarray            # [n] int64 dense ids 1..num_items
    original_items: np.ndarray   # [n] original ids
    timestamps: np.ndarray | None  # [n] int64 unix seconds; None for an untimed user


@dataclass(frozen=True)
class UserSequences:
    """Every user's events in time order, dense item ids, stored as CSR.

    User ``u`` (dense index ``0..num_users-1``, in sorted order of ``user_ids``) owns
    ``items[offsets[u]:offsets[u + 1]]``; ``timestamps`` is meaningful for timed users only
    (``timed[u]``), 0 elsewhere; ``lines`` holds each event's line in ``source`` (the table's
    ``lines``), so that a check of the sequences can point at the row. Every user has at least
    one event.
    """

    source: str
    id_map: IdMap
    user_ids: np.ndarray   # [U] original user ids
    offsets: np.ndarray    # [U + 1] int64
    items: np.ndarray      # [E] int64 dense ids
    timestamps: np.ndarray  # [E] int64
    timed: np.ndarray      # [U] bool
    lines: np.ndarray      # [E] int64
    # the content fingerprint of the table they were built from, as read (before any unknown
    # item was dropped): what a run records of its data (relaygr.data.fingerprint)
    fingerprint: str

    @cached_property
    def sequence_fingerprint(self) -> str:
        """The content fingerprint of these sequences, each user's events in its order (items
        and kept timestamps; ``relaygr.data.fingerprint``): what a run records of its sequences
        beside its table's ``fingerprint``, since the same rows in another file order can order
        a user's events otherwise (events of one timestamp keep their file order)."""
        return sequence_fingerprint(self.user_ids, self.offsets, np.asarray(self.id_map.items),
                                    self.items, self.timestamps, self.timed)

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        return self.id_map.num_items

    @property
    def num_events(self) -> int:
        return len(self.items)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def all_timed(self) -> bool:
        return bool(self.timed.all())

    def sequence(self, user: int) -> np.ndarray:
        return self.items[self.offsets[user]:self.offsets[user + 1]]

    def times(self, user: int) -> np.ndarray | None:
        if not self.timed[user]:
            return None
        return self.timestamps[self.offsets[user]:self.offsets[user + 1]]

    def history(self, user: int) -> UserEvents:
        items = self.sequence(user)
        return UserEvents(_plain(self.user_ids[user]), items, self.id_map.original_ids(items),
                          self.times(user))

    def histories(self) -> Iterator[UserEvents]:
        for user in range(self.num_users):
            yield self.history(user)


def _order_keys(table: InteractionTable, users: np.ndarray, num_users: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Row permutation putting each user's events in sequence order, and each user's timed flag."""
    rows = np.arange(table.num_rows)
    timed = np.zeros(num_users, dtype=bool)
    if table.has_time_column:
        assert table.has_timestamp is not None and table.timestamps is not None
        missing = np.bincount(users, weights=~table.has_timestamp, minlength=num_users)
        timed = missing == 0
    if table.order is not None:
        perm = np.lexsort((table.order, users))
        same = (users[perm][1:] == users[perm][:-1]) & \
               (table.order[perm][1:] == table.order[perm][:-1])
        if same.any():
            row = perm[1:][same][0]
            raise DataFormatError(f"order value {int(table.order[row])} repeats for this user",
                                  table.source, int(table.lines[row]))
        return perm, timed
    if table.has_time_column:
        assert table.timestamps is not None
        key = np.where(timed[users], table.timestamps, 0)
        return np.lexsort((rows, key, users)), timed
    return np.lexsort((rows, users)), timed


def build_sequences(table: InteractionTable, id_map: IdMap | None = None,
                    drop_unknown_items: bool = False) -> UserSequences:
    """Group ``table`` into ordered user sequences (see the module docstring for the rules).

    With ``id_map`` the items are mapped through it: an item it does not know raises
    ``DataFormatError`` at its line, or is dropped when ``drop_unknown_items``. Without one,
    the map is fitted to the table.
    """
    fingerprint = table_fingerprint(table)
    mapping = id_map or IdMap.fit(table.items)
    dense_items = mapping.dense_ids(table.items)
    keep = dense_items > 0
    if not keep.all():
        if not drop_unknown_items:
            row = int(np.flatnonzero(~keep)[0])
            raise DataFormatError(f"item {_plain(table.items[row])!r} is not in the id map",
                                  table.source, int(table.lines[row]))
        table = _subset(table, keep)
        dense_items = dense_items[keep]
    user_ids, users = np.unique(table.users, return_inverse=True)
    users = users.reshape(-1)
    perm, timed = _order_keys(table, users, len(user_ids))
    counts = np.bincount(users, minlength=len(user_ids))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    stamps = np.zeros(table.num_rows, dtype=np.int64) if table.timestamps is None else \
        table.timestamps[perm]
    return UserSequences(source=table.source, id_map=mapping, user_ids=user_ids,
                         offsets=offsets, items=dense_items[perm], timestamps=stamps,
                         timed=timed, lines=table.lines[perm], fingerprint=fingerprint)


def _subset(table: InteractionTable, keep: np.ndarray) -> InteractionTable:
    def pick(column: np.ndarray | None) -> np.ndarray | None:
        return None if column is None else column[keep]

    return InteractionTable(source=table.source, users=table.users[keep],
                            items=table.items[keep], timestamps=pick(table.timestamps),
                            has_timestamp=pick(table.has_timestamp), order=pick(table.order),
                            lines=table.lines[keep])
