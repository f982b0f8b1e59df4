"""What of a dataset a trained model can serve: checked before a run trains, and again before
``relaygr serve`` builds a user from it.

A checkpoint serves the users of the data it was trained on and no other
(``server.served_data``), so data that serving cannot hold must be refused before training, or
the run is a model nothing can serve. Training and serving call the same checks, with the same
errors:

* ``check_user_ids``: every user id an integer in ``0..MAX_USER_ID`` (2^53-1). A caller names a
  served user by that id (the API's ``user_id``, a JSON integer: 2^53-1 is the largest every JSON
  parser holds exactly), and every history store and the event log keep it as given. Ids that
  are strings (``readers.read_table`` keeps a user column with any non-integer value as strings)
  are refused, not mapped to integers: an integer the server made up would mean nothing to the
  caller, who knows the user by its own id; the one who holds the strings keeps the map from
  them to integers and trains on those. Ids past 2^53-1 (64-bit hashed ids) are refused for the
  same reason: no request could name them. ``ConfigError`` naming the file, the first such id
  and how many there are.
* ``check_timestamp_bound`` (a model that reads time only): each timed user's timestamps unix
  seconds in ``0..MAX_TIMESTAMP_S`` (2^40), the API's bound (``server.schemas.Timestamp``) and
  every history store's (``cascade.history_checks``). A user stamped past it could be loaded,
  but no ``/v1/events`` for it could follow: an event a request can carry would be before the
  user's latest. A value past 2^40 s (the year ~36,800) is most likely milliseconds.
  ``DataError`` at the line of the first such event (in file order), naming its value and user.
* ``check_time_order`` (a model that reads time only): each timed user's timestamps
  non-decreasing in its sequence's order. With an order column the sequence follows the column
  (``sequences``) and its timestamps may go back, but a timed user's history in every store is
  in time order (``cascade.history_checks``: an event before the user's latest is refused, as
  at ``/v1/events``), so serving could not load such a user. A model without time features
  never reads timestamps (its users are untimed in the store), so it trains on and serves such
  data. ``DataError`` at the line of the first event whose time goes back, naming its user and
  its position in the user's sequence.

``check_times`` runs both, the bound first (a wrong unit is the cause to name).
"""

from __future__ import annotations

import re

import numpy as np

from relaygr.data.sequences import UserSequences
from relaygr.errors import ConfigError, DataError

# The largest user id served: the API's bound (``server.schemas.UserId``), which every history
# store checks too (``cascade.history_checks.check_user``), so none holds a user no request
# can name.
MAX_USER_ID = (1 << 53) - 1
# The largest timestamp served, in unix seconds: the API's bound (``server.schemas.Timestamp``),
# which every history store checks too. Far enough in the future for any log (the year
# ~36,800), small enough that no gap overflows; a stamp in milliseconds of any time since
# November 2004 (2^40 ms) is past it, so such a log is refused rather than served as the
# distant future.
MAX_TIMESTAMP_S = 1 << 40

_INTEGER = re.compile(r"[+-]?\d+")
_RENUMBER = ("relaygr serves a user by the integer id a request names (0..2^53-1, what JSON "
             "carries exactly); number the users in that range, keep the map from your ids to "
             "those, and train on the renumbered data")


def check_user_ids(source: str, user_ids: np.ndarray) -> None:
    """``ConfigError`` unless every one of ``user_ids`` (a table's column or a sequences'
    users: any order, repeats counted once), read from ``source``, is an integer in
    ``0..MAX_USER_ID`` (the module docstring); the first named is the smallest."""
    ids = np.unique(user_ids)
    total = len(ids)
    if ids.dtype.kind not in "iu":
        named = [u for u in ids.tolist() if not _INTEGER.fullmatch(str(u))]
        first = named[0] if named else ids[0]
        raise ConfigError(
            f"{source} names its users by strings ({len(named) or total} of its {total} user "
            f"ids are not integers, the first {first!r}): {_RENUMBER}")
    outside = (ids < 0) | (ids > MAX_USER_ID)
    if outside.any():
        raise ConfigError(
            f"{source} has user ids outside 0..2^53-1 ({int(outside.sum())} of its {total} "
            f"users, the first {int(ids[outside][0])}): {_RENUMBER}")


def check_time_order(sequences: UserSequences) -> None:
    """``DataError`` unless each timed user's timestamps in ``sequences`` are non-decreasing in
    the user's sequence order; untimed users are not read (the module docstring)."""
    owner = np.repeat(np.arange(sequences.num_users), sequences.lengths)   # [E] user of event
    back = (np.diff(sequences.timestamps) < 0) & (owner[1:] == owner[:-1]) \
        & sequences.timed[owner[1:]]
    if not back.any():
        return
    event = int(np.flatnonzero(back)[0]) + 1
    user = int(owner[event])
    position = event - int(sequences.offsets[user])
    users = len(np.unique(owner[1:][back]))
    stamps = sequences.timestamps
    raise DataError(
        f"user {sequences.history(user).user_id!r}'s event at position {position} (0-based) "
        f"of its sequence, as the file orders it, has timestamp {int(stamps[event])}, before "
        f"the {int(stamps[event - 1])} of the event before it (time goes back for {users} of "
        f"the {int(sequences.timed.sum())} timed users): a model that reads time "
        "(use_timestamps) needs each user's timestamps non-decreasing in the order of its "
        "events; correct the timestamps or the order column, or train without use_timestamps",
        sequences.source, int(sequences.lines[event]))


def check_timestamp_bound(sequences: UserSequences) -> None:
    """``DataError`` unless each timed user's timestamps in ``sequences`` are unix seconds in
    ``0..MAX_TIMESTAMP_S``; untimed users are not read (the module docstring). The event named
    is the first outside, in file order."""
    owner = np.repeat(np.arange(sequences.num_users), sequences.lengths)   # [E] user of event
    stamps = sequences.timestamps
    outside = ((stamps < 0) | (stamps > MAX_TIMESTAMP_S)) & sequences.timed[owner]
    if not outside.any():
        return
    events = np.flatnonzero(outside)
    event = int(events[np.argmin(sequences.lines[events])])
    value = int(stamps[event])
    cause = ("as seconds that is past the year 36,800: most likely milliseconds (divide by "
             "1000) or microseconds" if value > MAX_TIMESTAMP_S else "that is before 1970")
    raise DataError(
        f"user {sequences.history(int(owner[event])).user_id!r} has timestamp {value}, "
        f"outside the 0..2^40 unix seconds a request can carry ({len(events)} of the "
        f"{int(sequences.lengths[sequences.timed].sum())} events of timed users): {cause}. A "
        "model that reads time (use_timestamps) needs timestamps in unix seconds; convert them, "
        "or train without use_timestamps", sequences.source, int(sequences.lines[event]))


def check_times(sequences: UserSequences) -> None:
    """What a model that reads time needs of ``sequences``: ``check_timestamp_bound``, then
    ``check_time_order``."""
    check_timestamp_bound(sequences)
    check_time_order(sequences)
