"""User behaviour histories: an append-only, time-ordered event log per user, with versions.

``version_at(user, n)`` is a 64-bit hash of the user's first ``n`` events (items and
timestamps). Appending never changes it for an existing ``n``, and any prefix that grows gets a
new value, so a cache entry built from ``n`` events is fresh exactly when
``version_at(user, n) == entry.version``. It costs O(1): the store keeps, per user, the running
sum (mod 2**64) of position-salted event hashes, computed with numpy when events arrive.

Windows (``cascade.window``): ``version_at(user, n, start)`` is the version of the events
``start..n-1`` read as a window of their own (the model sees them at positions ``0..n-start-1``).
It hashes the start too, so the same events read from another start (at other positions) have
another version, and ``start == 0`` gives the plain prefix version. Also O(1): the difference of
two running sums.

Snapshots (``HistorySnapshot``) are read-only numpy views that later appends never touch (appends
write past the snapshot's end or into a fresh buffer). Thread-safety: not thread-safe for
writers; the engine runs on one asyncio thread. Snapshots may be read from any thread.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from relaygr.cascade.eventlog import EventLog
from relaygr.cascade.history_checks import (
    as_int_array,
    check_count,
    check_expected,
    check_items,
    check_start,
    check_suffix_timestamps,
    check_timestamps,
    check_user,
)
from relaygr.engine.versions import event_hash_sums, version_of
from relaygr.errors import (
    ConfigError,
    HistoryStoreUnavailableError,
    InvalidInputError,
    UnknownUserError,
)
from relaygr.settings import load

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class HistorySnapshot:
    """A user's first ``num_events`` events: ``items`` ``[n]`` int64 (ids >= 1), ``timestamps``
    ``[n]`` int64 seconds, non-decreasing, or None for an untimed user; ``version`` is
    ``version_at(user_id, n)``. The arrays are read-only and never change."""

    user_id: int
    items: np.ndarray
    timestamps: np.ndarray | None
    version: int

    @property
    def num_events(self) -> int:
        return int(self.items.shape[0])


class HistoryStore(ABC):
    """Per-user event logs. Every method raises ``UnknownUserError`` for a user it does not
    hold (``append`` creates users instead) and ``InvalidInputError`` subclasses for malformed
    ids or events, changing nothing."""

    @abstractmethod
    def get(self, user_id: int) -> HistorySnapshot:
        """The user's whole history now."""

    @abstractmethod
    def prefix(self, user_id: int, num_events: int) -> HistorySnapshot:
        """The user's first ``num_events`` events (0 <= num_events <= length)."""

    @abstractmethod
    def append(self, user_id: int, items: npt.ArrayLike,
               timestamps: npt.ArrayLike | None = None,
               expected_events: int | None = None) -> HistorySnapshot:
        """Add events after the user's last one (creating the user); returns the new history.
        ``expected_events``: only when the user has exactly that many events now (0: a user the
        store does not hold), else ``HistoryConflictError`` and nothing appended; checked
        atomically with the append (``history_checks.check_expected``)."""

    @abstractmethod
    def version_after(self, user_id: int, num_events: int, items: npt.ArrayLike,
                      timestamps: npt.ArrayLike | None = None, start: int = 0) -> int:
        """The version the user's events ``start..num_events-1`` followed by ``items`` would
        have (what ``version_at(user, num_events + len(items), start)`` returns once they are
        appended there); changes nothing."""

    @abstractmethod
    def version_at(self, user_id: int, num_events: int, start: int = 0) -> int:
        """Hash of the user's events ``start..num_events-1`` (the first ``num_events`` when
        ``start`` is 0) and of ``start``, in O(1); ``0 <= start <= num_events <= length``."""

    @abstractmethod
    def num_events(self, user_id: int) -> int:
        """How many events the user has now."""

    def reachable(self) -> bool:
        """Whether the store answers now (readiness): ``unavailable()`` is None."""
        return self.unavailable() is None

    def unavailable(self) -> str | None:
        """Why the store cannot serve now (what ``/readyz`` reports), or None when it can; a
        store in this process can, unless its event log refused its last write."""
        return None

    def log_write_failures(self) -> int:
        """Appends the store's event log refused since it was opened (0 without a log)."""
        return 0

    def close(self) -> None:  # noqa: B027 (a store with nothing to let go keeps this)
        """Let go of what the store holds outside its memory (a file, connections). An append
        acknowledged after it must still be durable: a store that can no longer make it so
        refuses it (``HistoryStoreUnavailableError``) rather than keep it in memory only."""

    @abstractmethod
    def __contains__(self, user_id: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[int]:
        """User ids, in the order they were added."""


class _UserLog:
    """One user's growable arrays; ``sums[i]`` is the hash sum of the first ``i`` events."""

    def __init__(self, timed: bool) -> None:
        self.timed = timed
        self.length = 0
        self.items = np.empty(16, dtype=np.int64)
        self.timestamps = np.empty(16, dtype=np.int64) if timed else None
        self.sums = np.zeros(17, dtype=np.uint64)

    def extend(self, items: np.ndarray, timestamps: np.ndarray | None) -> None:
        n, k = self.length, items.shape[0]
        if n + k > self.items.shape[0]:
            capacity = max(2 * self.items.shape[0], n + k)
            self.items = np.concatenate([self.items[:n], np.empty(capacity - n, np.int64)])
            if self.timestamps is not None:
                self.timestamps = np.concatenate(
                    [self.timestamps[:n], np.empty(capacity - n, np.int64)])
            self.sums = np.concatenate([self.sums[:n + 1], np.zeros(capacity - n, np.uint64)])
        self.items[n:n + k] = items
        if self.timestamps is not None:
            assert timestamps is not None
            self.timestamps[n:n + k] = timestamps
        self.sums[n + 1:n + k + 1] = event_hash_sums(items, timestamps, n, int(self.sums[n]))
        self.length = n + k

    def version(self, start: int, stop: int) -> int:
        """The version of events ``start..stop-1`` (``version_of`` their hash sum)."""
        hash_sum = (int(self.sums[stop]) - int(self.sums[start])) & _MASK64
        return version_of(hash_sum, stop - start, self.timed, start)

    def snapshot(self, user_id: int, n: int) -> HistorySnapshot:
        items = self.items[:n].view()
        items.flags.writeable = False
        ts = None
        if self.timestamps is not None:
            ts = self.timestamps[:n].view()
            ts.flags.writeable = False
        return HistorySnapshot(user_id, items, ts, self.version(0, n))


class InMemoryHistoryStore(HistoryStore):
    """A ``HistoryStore`` in process memory. ``num_items`` (when given) bounds item ids to the
    model's catalogue 1..num_items; ids must be >= 1 in any case (0 is padding)."""

    def __init__(self, num_items: int | None = None) -> None:
        if num_items is not None and (not isinstance(num_items, int) or num_items < 1):
            raise InvalidInputError(f"num_items must be an int >= 1, got {num_items!r}")
        self.num_items = num_items
        self._logs: dict[int, _UserLog] = {}
        self._events: EventLog | None = None   # appends written to disk (persist_to)
        self._closed = False                   # close() was called: appends are refused

    @classmethod
    def from_sequences(cls, sequences: Mapping[int, tuple[npt.ArrayLike, npt.ArrayLike | None]],
                       num_items: int | None = None) -> InMemoryHistoryStore:
        """A store holding ``{user_id: (items, timestamps or None)}`` (time-ordered events)."""
        store = cls(num_items)
        for user_id, (items, timestamps) in sequences.items():
            store.append(user_id, items, timestamps)
        return store

    @classmethod
    def synthetic(cls, config: SyntheticHistories) -> InMemoryHistoryStore:
        """A store of generated users (see ``SyntheticHistories``), with ``num_items`` set."""
        store = cls(config.num_items)
        for user_id, (items, timestamps) in generate_histories(config).items():
            store.append(user_id, items, timestamps)
        return store

    def get(self, user_id: int) -> HistorySnapshot:
        log = self._log(user_id)
        return log.snapshot(user_id, log.length)

    def prefix(self, user_id: int, num_events: int) -> HistorySnapshot:
        log = self._log(user_id)
        return log.snapshot(user_id, check_count(log.length, num_events))

    def version_at(self, user_id: int, num_events: int, start: int = 0) -> int:
        log = self._log(user_id)
        n = check_count(log.length, num_events)
        return log.version(check_start(start, n), n)

    def num_events(self, user_id: int) -> int:
        return self._log(user_id).length

    def version_after(self, user_id: int, num_events: int, items: npt.ArrayLike,
                      timestamps: npt.ArrayLike | None = None, start: int = 0) -> int:
        log = self._log(user_id)
        n = check_count(log.length, num_events)
        first = check_start(start, n)
        ids = as_int_array("items", items)
        if ids.size == 0:
            return log.version(first, n)
        ts = check_suffix_timestamps(log.timed, ids, timestamps)
        sums = event_hash_sums(ids, ts, n, int(log.sums[n]))
        hash_sum = (int(sums[-1]) - int(log.sums[first])) & _MASK64
        return version_of(hash_sum, n + ids.size - first, log.timed, first)

    def append(self, user_id: int, items: npt.ArrayLike,
               timestamps: npt.ArrayLike | None = None,
               expected_events: int | None = None) -> HistorySnapshot:
        check_user(user_id)
        if self._closed:
            raise HistoryStoreUnavailableError(self._closed_reason())
        ids = check_items(items, self.num_items)
        log = self._logs.get(user_id)
        check_expected(user_id, expected_events, 0 if log is None else log.length)
        last_ts = None
        if log is not None and log.timestamps is not None and log.length:
            last_ts = int(log.timestamps[log.length - 1])
        ts = check_timestamps(timestamps is not None if log is None else log.timed, last_ts,
                              ids, timestamps)
        if self._events is not None:    # recorded first: an append the log refused (typed)
            self._events.record(user_id, ids, ts)      # is not served, nor doubled by a retry
        if log is None:
            log = _UserLog(timed=ts is not None)
            self._logs[user_id] = log
        log.extend(ids, ts)
        return log.snapshot(user_id, log.length)

    def persist_to(self, path: Path, adopt: bool = False) -> int:
        """Replay the appends recorded at ``path`` onto this store (built from the same base
        data as when they were recorded), then record every later append there before it
        returns (``cascade.eventlog``). Returns how many appends were replayed. A log that
        records no base but holds appends is refused unless ``adopt`` (the caller knows they
        were made on these users)."""
        assert self._events is None, "persist_to once"
        events = EventLog(path)
        base, recorded = self.base_digest(), events.base()
        if recorded != base and (recorded is not None or (len(events) and not adopt)):
            held = len(events)
            events.close()
            whose = "another user base" if recorded is not None else \
                "a user base it did not record (an older relaygr)"
            raise ConfigError(
                f"the event log {path} holds {held} appends made on {whose} than the users "
                "served now (another dataset, synthetic users or history window): replayed, "
                "they would change these users' histories. Serve with another log (--events "
                "PATH) or none (--events none), or remove it to start afresh"
                + ("" if recorded is not None else "; or, if they were made on these users, "
                   "take the log as theirs (--events-adopt)"))
        if recorded is None:
            events.set_base(base)
        replayed = 0
        try:
            for user_id, items, timestamps in events.replay():
                self.append(user_id, items, timestamps)
                replayed += 1
        except BaseException:     # the server does not start: the log (and its lock) is let go
            events.close()
            raise
        self._events = events
        return replayed

    def unavailable(self) -> str | None:
        """The event log's refusal while its last write was refused (``EventLog.unavailable``:
        until a write, or its probe, succeeds); None without a log. A closed store takes no
        appends."""
        if self._closed:
            return self._closed_reason()
        return None if self._events is None else self._events.unavailable()

    def log_write_failures(self) -> int:
        return 0 if self._events is None else self._events.refused_appends

    def base_digest(self) -> str:
        """A digest of every user's history (id, length, event hash sum, timed or not): what
        an event log checks that its appends are replayed onto (``persist_to``)."""
        digest = hashlib.sha256()
        for user_id in sorted(self._logs):
            log = self._logs[user_id]
            digest.update(f"{user_id}:{log.length}:{int(log.sums[log.length])}:"
                          f"{int(log.timed)};".encode())
        return digest.hexdigest()

    def close(self) -> None:
        """Close the event log, if any. From then on every append is refused with
        ``HistoryStoreUnavailableError`` and nothing is kept: one answered after the log is
        gone (a request that outlived a timed-out drain) would be acknowledged but lost on
        restart. Reads still answer."""
        self._closed = True
        if self._events is not None:
            self._events.close()
            self._events = None

    def _closed_reason(self) -> str:
        return "the history store is closed (its event log let go): nothing appended"

    def __contains__(self, user_id: object) -> bool:
        return user_id in self._logs

    def __len__(self) -> int:
        return len(self._logs)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._logs))

    def _log(self, user_id: int) -> _UserLog:
        check_user(user_id)
        log = self._logs.get(user_id)
        if log is None:
            raise UnknownUserError(f"user {user_id} has no history in this store")
        return log


@dataclass(frozen=True)
class SyntheticHistories:
    """Seeded generated histories: users ``first_user_id..``, lengths log-uniform in
    ``[min_events, max_events]``, items drawn by Zipf popularity (rank r has weight
    ``r ** -zipf_exponent``; which id holds which rank is a seeded permutation), and, when
    ``timed``, timestamps from ``start_ts`` with exponential gaps of mean ``mean_gap_s``."""

    num_users: int
    num_items: int
    min_events: int = 16
    max_events: int = 1024
    # 1.0 is close to the head of real interaction logs (MovieLens, Amazon) by item popularity.
    zipf_exponent: float = 1.0
    timed: bool = True
    start_ts: int = 1_600_000_000
    # One event an hour on average: a day of behaviour is a couple of dozen events.
    mean_gap_s: float = 3600.0
    first_user_id: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.num_users >= 1 and self.num_items >= 1
                and 1 <= self.min_events <= self.max_events):
            raise ConfigError("SyntheticHistories needs num_users >= 1, num_items >= 1 and "
                              "1 <= min_events <= max_events")
        if self.zipf_exponent < 0 or self.mean_gap_s < 0 or self.first_user_id < 0:
            raise ConfigError("zipf_exponent, mean_gap_s and first_user_id must be >= 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SyntheticHistories:
        return load(cls, data)


def generate_histories(config: SyntheticHistories
                       ) -> dict[int, tuple[np.ndarray, np.ndarray | None]]:
    """``{user_id: (items, timestamps or None)}`` for ``config``; the same for the same seed."""
    rng = np.random.default_rng(config.seed)
    log_lengths = rng.uniform(np.log(config.min_events), np.log(config.max_events + 1),
                              size=config.num_users)
    lengths = np.minimum(np.exp(log_lengths).astype(np.int64), config.max_events)
    weights = np.arange(1, config.num_items + 1, dtype=np.float64) ** -config.zipf_exponent
    id_of_rank = rng.permutation(config.num_items) + 1
    ranks = rng.choice(config.num_items, size=int(lengths.sum()), p=weights / weights.sum())
    items = id_of_rank[ranks]
    out: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for u in range(config.num_users):
        user_items = items[offsets[u]:offsets[u + 1]]
        ts = None
        if config.timed:
            gaps = np.asarray(rng.exponential(config.mean_gap_s, size=user_items.shape[0]))
            gaps = gaps.astype(np.int64)
            ts = config.start_ts + np.cumsum(gaps)
        out[config.first_user_id + u] = (user_items, ts)
    return out
