"""``RedisHistoryStore``: the history store shared by every server process, kept in Redis.

Keys (``NS`` is the namespace, ``relaygr`` by default; one namespace serves one catalogue)::

    NS:catalogue           the catalogue's size (``num_items``), set by the first process
    NS:users               a list of user ids, in the order the users were added
    NS:user:ID:items       the user's item ids, packed little-endian int64, oldest first
    NS:user:ID:ts          their timestamps, the same way (only for a timed user)
    NS:user:ID:sums        the running hash sums: entry i-1 (uint64) is the sum over the first
                           i events (``engine.versions.event_hash_sums``)

Versions are derived from what the store holds: ``version_at(user, n, start)`` reads the two sums at
``n`` and ``start`` and applies ``engine.versions.version_of``, so it is O(1) and equal, for the
same events, to ``InMemoryHistoryStore``'s in every process.

Appends are atomic per user: the client reads the user's tail (length, newest sum and timestamp)
in one script, checks the events and computes their sums from it, and one write script appends
items, timestamps and sums only when the user's length is still the one read (compare-and-set;
append-only means same length, same history); when another appender got there first nothing is
written and the client reads again. An append's ``expected_events`` is checked against the
length read, so it holds at the write as the compare-and-set does. A user is created by the same
script (length 0), so two appenders never interleave, lose or duplicate events, and a reader
sees an append whole or not at all. ``add_absent`` creates users that are absent and leaves
present ones alone (what a second server starting on the same store needs).

Failures: the client does not retry by itself (a retried write could be applied twice), so a
connection error, a timeout or a refusal (out of memory, read-only) is a
``HistoryStoreUnavailableError`` at once; the store is never left holding part of an append.
Input is checked by ``cascade.history_checks``, as the in-memory store checks it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

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
from relaygr.cascade.redis_scripts import APPEND, READ, SUMS, TORN
from relaygr.cascade.store import HistorySnapshot, HistoryStore
from relaygr.engine.versions import event_hash_sums, version_of
from relaygr.errors import ConfigError, HistoryStoreUnavailableError, UnknownUserError

URL_SCHEMES = ("redis://", "rediss://", "unix://")
_MASK64 = (1 << 64) - 1
_WORD = 8                 # bytes per packed event field
_MAX_TRIES = 64           # compare-and-set rounds an append may lose before it gives up
_SEED_BATCH = 256         # users per round trip when add_absent fills the store


def check_store_url(url: str) -> str:
    """``url`` when it names a Redis server (``redis://HOST:PORT[/DB]``, ``rediss://``,
    ``unix://PATH``), else a ConfigError."""
    if not isinstance(url, str) or not url.startswith(URL_SCHEMES) or url.endswith("://"):
        raise ConfigError(f"a history store is named redis://HOST:PORT[/DB] (or rediss://, "
                          f"unix://PATH), got {url!r}")
    return url


def _ints(raw: bytes, dtype: str = "<i8") -> np.ndarray:
    return np.frombuffer(raw, dtype=dtype).astype(np.int64 if dtype == "<i8" else np.uint64)


def _word(raw: bytes) -> int:
    """A packed uint64 (b'' is the empty sum, 0)."""
    return int.from_bytes(raw, "little") if raw else 0


@dataclass(frozen=True)
class _Sums:
    """What the ``_SUMS`` script read of one user: ``length`` events, whether timed, the sums
    asked for, and the newest timestamp (None when untimed or empty)."""

    length: int
    timed: bool
    sums: tuple[int, ...]
    last_ts: int | None


class RedisHistoryStore(HistoryStore):
    """A ``HistoryStore`` in Redis, shared by every process that opens the same server and
    namespace (see the module docstring). Thread-safe (the client pools connections)."""

    def __init__(self, client: redis.Redis, num_items: int | None = None,
                 namespace: str = "relaygr", location: str = "redis") -> None:
        self.num_items = num_items
        self.namespace = namespace
        self.location = location
        self._client = client
        self._append = client.register_script(APPEND)
        self._sums_script = client.register_script(SUMS)
        self._read_script = client.register_script(READ)
        self._check_catalogue()

    @classmethod
    def connect(cls, url: str, num_items: int | None = None, namespace: str = "relaygr",
                timeout_s: float = 2.0) -> RedisHistoryStore:
        """Open the store at ``url`` (``check_store_url``); ``HistoryStoreUnavailableError``
        when it does not answer within ``timeout_s``, ConfigError when it holds another
        catalogue. Connection errors are never retried (see the module docstring)."""
        client = redis.Redis.from_url(check_store_url(url), socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 0))
        return cls(client, num_items, namespace, url)

    def _keys(self, user_id: int) -> list[str]:
        base = f"{self.namespace}:user:{int(user_id)}"
        return [f"{base}:items", f"{base}:ts", f"{base}:sums", f"{self.namespace}:users"]

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as exc:
            raise HistoryStoreUnavailableError(
                f"the history store at {self.location} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _check_catalogue(self) -> None:
        key = f"{self.namespace}:catalogue"
        with self._reaching():
            self._client.set(key, str(self.num_items or 0), nx=True)
            held = int(self._client.get(key) or 0)
        if held != (self.num_items or 0):
            raise ConfigError(
                f"the history store at {self.location} (namespace {self.namespace!r}) holds "
                f"histories of a catalogue of {held or 'unbounded'} items; this model has "
                f"{self.num_items or 'unbounded'}: use another database or namespace")

    def _sums(self, user_id: int, *counts: int) -> _Sums:
        check_user(user_id)
        keys = self._keys(user_id)[:3]
        with self._reaching():
            out = self._sums_script(keys=keys, args=[int(k) for k in counts])
        self._whole(user_id, out[0])
        length, timed = int(out[0]) // _WORD, bool(out[1])
        last_ts = _ints(out[2 + len(counts)])[0] if timed and length else None
        return _Sums(length, timed, tuple(_word(raw) for raw in out[2:2 + len(counts)]),
                     None if last_ts is None else int(last_ts))

    def _read(self, user_id: int, num_events: int | None) -> HistorySnapshot:
        check_user(user_id)
        with self._reaching():
            out = self._read_script(keys=self._keys(user_id)[:3],
                                    args=[-1 if num_events is None else int(num_events)])
        self._whole(user_id, out[0])
        length, timed = int(out[0]) // _WORD, bool(out[1])
        if length == 0:
            raise UnknownUserError(f"user {user_id} has no history in this store")
        n = check_count(length, length if num_events is None else num_events)
        items = _ints(out[2])
        ts = _ints(out[3]) if timed else None
        return self._history(user_id, items, ts, _word(out[4]), n)

    def _whole(self, user_id: int, out: Any) -> None:
        """``HistoryStoreUnavailableError`` where a script found the user's keys torn."""
        if out == TORN:
            raise HistoryStoreUnavailableError(
                f"user {user_id}'s keys in the history store at {self.location} disagree "
                "(items, timestamps and sums of different lengths): one was lost to an "
                "eviction, an expiry or a DEL; run Redis with maxmemory-policy noeviction and "
                "no expiry on these keys, and restore or remove the user")

    @staticmethod
    def _history(user_id: int, items: np.ndarray, ts: np.ndarray | None, hash_sum: int,
                 n: int) -> HistorySnapshot:
        assert items.shape[0] == n and (ts is None or ts.shape[0] == n), "a torn read"
        items.flags.writeable = False
        if ts is not None:
            ts.flags.writeable = False
        return HistorySnapshot(user_id, items, ts, version_of(hash_sum, n, ts is not None))

    def get(self, user_id: int) -> HistorySnapshot:
        return self._read(user_id, None)

    def prefix(self, user_id: int, num_events: int) -> HistorySnapshot:
        if not isinstance(num_events, (int, np.integer)) or isinstance(num_events, bool) \
                or num_events < 0:
            check_count(self.num_events(user_id), num_events)   # raises for this user
        return self._read(user_id, num_events)

    def num_events(self, user_id: int) -> int:
        state = self._sums(user_id)
        if state.length == 0:
            raise UnknownUserError(f"user {user_id} has no history in this store")
        return state.length

    def _window_sums(self, user_id: int, num_events: int, start: int) -> tuple[_Sums, int, int]:
        """The user's sums at ``num_events`` and ``start`` (both checked)."""
        ok = isinstance(num_events, (int, np.integer)) and isinstance(start, (int, np.integer))
        state = self._sums(user_id, *((num_events, start) if ok else ()))
        if state.length == 0:
            raise UnknownUserError(f"user {user_id} has no history in this store")
        n = check_count(state.length, num_events)
        return state, n, check_start(start, n)

    def version_at(self, user_id: int, num_events: int, start: int = 0) -> int:
        state, n, first = self._window_sums(user_id, num_events, start)
        hash_sum = (state.sums[0] - state.sums[1]) & _MASK64
        return version_of(hash_sum, n - first, state.timed, first)

    def version_after(self, user_id: int, num_events: int, items: npt.ArrayLike,
                      timestamps: npt.ArrayLike | None = None, start: int = 0) -> int:
        state, n, first = self._window_sums(user_id, num_events, start)
        ids = as_int_array("items", items)
        if ids.size == 0:
            return version_of((state.sums[0] - state.sums[1]) & _MASK64, n - first,
                              state.timed, first)
        ts = check_suffix_timestamps(state.timed, ids, timestamps)
        sums = event_hash_sums(ids, ts, n, state.sums[0])
        return version_of((int(sums[-1]) - state.sums[1]) & _MASK64, n + ids.size - first,
                          state.timed, first)

    def append(self, user_id: int, items: npt.ArrayLike,
               timestamps: npt.ArrayLike | None = None,
               expected_events: int | None = None) -> HistorySnapshot:
        """``expected_events`` is checked against the length read, which the write script's
        compare-and-set then requires: when another appender gets in between, the next round
        reads its length and the precondition fails, so the check is atomic with the write."""
        check_user(user_id)
        ids = check_items(items, self.num_items)
        for _ in range(_MAX_TRIES):
            tail = self._sums(user_id, -1)
            check_expected(user_id, expected_events, tail.length)
            timed = timestamps is not None if tail.length == 0 else tail.timed
            ts = check_timestamps(timed, tail.last_ts, ids, timestamps)
            sums = event_hash_sums(ids, ts, tail.length, tail.sums[0])
            with self._reaching():
                out = self._append(keys=self._keys(user_id),
                                   args=self._append_args(user_id, tail.length, ids, ts, sums))
            self._whole(user_id, out)
            if out != -1:
                n = int(out[0]) // _WORD
                return self._history(user_id, _ints(out[1]),
                                     None if ts is None else _ints(out[2]), int(sums[-1]), n)
        raise HistoryStoreUnavailableError(
            f"user {user_id}'s history changed under {_MAX_TRIES} appends in a row: too many "
            "concurrent appenders to one user")

    @staticmethod
    def _append_args(user_id: int, length: int, ids: np.ndarray, ts: np.ndarray | None,
                     sums: np.ndarray) -> list[Any]:
        return [length * _WORD, ids.astype("<i8").tobytes(),
                b"" if ts is None else ts.astype("<i8").tobytes(),
                sums.astype("<u8").tobytes(), int(user_id)]

    def add_absent(self, histories: Mapping[int, tuple[npt.ArrayLike, npt.ArrayLike | None]]
                   ) -> int:
        """Create each user of ``{user_id: (items, timestamps or None)}`` that the store does
        not hold, atomically per user; users it holds keep what they have. Returns how many
        were created. Every history is checked before anything is written."""
        checked = []
        for user_id, (items, timestamps) in histories.items():
            check_user(user_id)
            ids = check_items(items, self.num_items)
            ts = check_timestamps(timestamps is not None, None, ids, timestamps)
            checked.append((user_id, ids, ts, event_hash_sums(ids, ts, 0, 0)))
        created = 0
        for lo in range(0, len(checked), _SEED_BATCH):
            with self._reaching():
                pipe = self._client.pipeline(transaction=False)
                for user_id, ids, ts, sums in checked[lo:lo + _SEED_BATCH]:
                    self._append(keys=self._keys(user_id),
                                 args=self._append_args(user_id, 0, ids, ts, sums), client=pipe)
                outs = pipe.execute()
                for (user_id, *_), out in zip(checked[lo:lo + _SEED_BATCH], outs, strict=True):
                    self._whole(user_id, out)
                created += sum(out != -1 for out in outs)
        return created

    def check_integrity(self) -> None:
        """Assert that every user's items, timestamps and sums agree (tests call it)."""
        for user_id in self:
            history = self.get(user_id)
            with self._reaching():
                raw: Any = self._client.get(self._keys(user_id)[2]) or b""
            expected = event_hash_sums(history.items, history.timestamps, 0, 0)
            assert np.array_equal(_ints(raw, "<u8"), expected), f"user {user_id}'s sums"

    def unavailable(self) -> str | None:
        """None when the server answers a PING now (within the client's timeout)."""
        try:
            if self._client.ping():
                return None
        except redis.RedisError as exc:
            return (f"the history store at {self.location} does not answer: "
                    f"{type(exc).__name__}: {exc}")
        return f"the history store at {self.location} does not answer a PING"

    def close(self) -> None:
        """Close the client's connections (a later call opens new ones)."""
        self._client.close()

    def __contains__(self, user_id: object) -> bool:
        if not isinstance(user_id, (int, np.integer)) or isinstance(user_id, bool) \
                or user_id < 0:
            return False
        with self._reaching():
            return bool(self._client.exists(self._keys(int(user_id))[0]))

    def __len__(self) -> int:
        with self._reaching():
            return int(self._client.llen(f"{self.namespace}:users"))

    def __iter__(self) -> Iterator[int]:
        with self._reaching():
            users = self._client.lrange(f"{self.namespace}:users", 0, -1)
        return iter([int(u) for u in users])
