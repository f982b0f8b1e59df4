"""The checks every ``HistoryStore`` makes before it reads or changes a history.

One set of rules, so that each store (in memory, Redis) refuses the same input with the same
typed error and changes nothing: user ids are ints in ``0..2^53-1`` (the API's ``user_id``:
a user no request can name is not kept), item ids ints in ``1..num_items``,
counts and window starts within the history, and timestamps given exactly for timed users, one
per item, non-decreasing from the user's last event on, unix seconds in ``0..2^40`` (the API's
timestamp: a user stamped past it could take no event a request carries). Each function either
returns the checked value (as int64 arrays or ints) or raises an ``InvalidInputError`` subclass.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from relaygr.data.servable import MAX_TIMESTAMP_S, MAX_USER_ID
from relaygr.errors import (
    EmptyInputError,
    HistoryConflictError,
    InvalidInputError,
    ItemOutOfRangeError,
    TimestampError,
)


def check_user(user_id: int) -> None:
    """``InvalidInputError`` unless ``user_id`` is an int in ``0..MAX_USER_ID`` (2^53-1): the
    ids a request can name (``data.servable``), so that a store never holds a user the API
    cannot reach."""
    if not isinstance(user_id, (int, np.integer)) or isinstance(user_id, bool) \
            or not 0 <= user_id <= MAX_USER_ID:
        raise InvalidInputError(f"user_id must be an int in [0, 2^53-1], got {user_id!r}")


def as_int_array(name: str, values: npt.ArrayLike) -> np.ndarray:
    """``values`` as a 1-D int64 array (``InvalidInputError`` for another shape or dtype)."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise InvalidInputError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise InvalidInputError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64)


def check_items(items: npt.ArrayLike, num_items: int | None) -> np.ndarray:
    """An append's item ids: at least one, each in ``1..num_items`` (>= 1 when unbounded)."""
    ids = as_int_array("items", items)
    if ids.size == 0:
        raise EmptyInputError("append needs at least one event")
    low, high = int(ids.min()), int(ids.max())
    if low < 1 or (num_items is not None and high > num_items):
        upper = "" if num_items is None else f"..{num_items}"
        raise ItemOutOfRangeError(f"item id {low if low < 1 else high} is out of range; "
                                  f"valid ids are 1{upper}")
    return ids


def check_count(length: int, num_events: int) -> int:
    """``num_events`` as an int in ``[0, length]``."""
    if not isinstance(num_events, (int, np.integer)) or isinstance(num_events, bool) \
            or not 0 <= num_events <= length:
        raise InvalidInputError(f"num_events must be an int in [0, {length}], "
                                f"got {num_events!r}")
    return int(num_events)


def check_start(start: int, num_events: int) -> int:
    """A window's ``start`` as an int in ``[0, num_events]``."""
    if not isinstance(start, (int, np.integer)) or isinstance(start, bool) \
            or not 0 <= start <= num_events:
        raise InvalidInputError(f"start must be an int in [0, {num_events}], got {start!r}")
    return int(start)


def check_timed(timed: bool, timestamps: npt.ArrayLike | None) -> None:
    """``TimestampError`` unless timestamps are given exactly when the user is ``timed``."""
    if timed != (timestamps is not None):
        raise TimestampError(f"this user's history is {'timed' if timed else 'untimed'}; "
                             f"timestamps must be {'given' if timed else 'omitted'}")


def check_timestamps(timed: bool, last_ts: int | None, ids: np.ndarray,
                     timestamps: npt.ArrayLike | None) -> np.ndarray | None:
    """An append's timestamps (None for an untimed user): one per item, non-decreasing, none
    before ``last_ts`` (the user's newest event's, None for a user without events), each in
    ``0..MAX_TIMESTAMP_S``."""
    check_timed(timed, timestamps)
    if timestamps is None:
        return None
    ts = as_int_array("timestamps", timestamps)
    if ts.shape != ids.shape:
        raise TimestampError(f"{ids.size} items but {ts.size} timestamps")
    if np.any(np.diff(ts) < 0) or (last_ts is not None and int(ts[0]) < last_ts):
        raise TimestampError("events must be appended in time order (timestamps "
                             "non-decreasing, from the user's last event on)")
    if ts.size and (int(ts.min()) < 0 or int(ts.max()) > MAX_TIMESTAMP_S):
        raise TimestampError("timestamps must be unix seconds in [0, 2^40] (what a request "
                             f"carries), got {int(ts.min() if ts.min() < 0 else ts.max())}")
    return ts


def check_suffix_timestamps(timed: bool, ids: np.ndarray,
                            timestamps: npt.ArrayLike | None) -> np.ndarray | None:
    """``version_after``'s timestamps: given exactly when timed, one per item."""
    check_timed(timed, timestamps)
    ts = None if timestamps is None else as_int_array("timestamps", timestamps)
    if ts is not None and ts.shape != ids.shape:
        raise TimestampError(f"{ids.size} items but {ts.size} timestamps")
    return ts


def check_expected(user_id: int, expected_events: int | None, num_events: int) -> None:
    """An append's precondition: ``HistoryConflictError`` unless the user has exactly
    ``expected_events`` events (0 for a user the store does not hold); None checks nothing.
    Checked before the timestamps, so that a retried append is told it was applied rather
    than that its timestamps now go back in time."""
    if expected_events is None:
        return
    if not isinstance(expected_events, (int, np.integer)) or isinstance(expected_events, bool) \
            or expected_events < 0:
        raise InvalidInputError(f"expected_events must be an int >= 0, got {expected_events!r}")
    if expected_events != num_events:
        raise HistoryConflictError(user_id, int(expected_events), num_events)
