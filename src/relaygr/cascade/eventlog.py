"""Appended events on disk, so that a restart loses no event the server acknowledged.

The served users' histories are built at start-up from the dataset; what arrives while serving
(``/v1/events``, and the recent items of every visit, appended after ranking) lives in the
``HistoryStore`` and, once ``InMemoryHistoryStore.persist_to`` is on, also in an ``EventLog``:
one SQLite database in WAL mode (standard library, one writer, the serving event loop's
thread). An append is written and committed before the store returns, so before the request is
answered; ``synchronous=NORMAL`` makes a commit survive the process's death (an operating
system crash may lose the last few). At start-up the log is replayed, in order, onto the
freshly built store: the histories, and therefore every prefix version, are what they were.

The commit stays on the serving loop's thread, as every ``HistoryStore.append`` does (the
interface is synchronous, called under the user's lock, and an append is acknowledged only once
it is durable), so while SQLite waits for its write lock no other request runs. This process is
the log's only writer (the lock file below), so a lock held for long is another program's (a
backup, the ``sqlite3`` shell): an append waits at most ``APPEND_BUSY_TIMEOUT_S`` for it and is
then refused (``HistoryStoreUnavailableError``, a 503), which bounds the stall; SQLite's default
of 5 s stalled every request, ``/healthz`` included, for 5 s per append. After a refused write
the log reports itself unavailable (``unavailable``, what ``/readyz`` reads) until a write
succeeds again: an append, or the probe write ``unavailable`` makes meanwhile, so readiness comes
back once the lock is let go even with no traffic routed to the server.

A log belongs to the user base its appends were made on: the first store it is opened with
records a digest of its histories (``InMemoryHistoryStore.base_digest``) in the log, and a store
built from other users (another dataset, synthetic users, another history window) is refused
(``ConfigError``) rather than having those appends replayed onto its users. A log written before
logs recorded their base cannot say whose it is: one that holds appends is refused the same way.
"""

from __future__ import annotations

import fcntl
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from relaygr.errors import ConfigError, HistoryStoreUnavailableError

_SCHEMA = """CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id INTEGER NOT NULL,
    items BLOB NOT NULL,
    timestamps BLOB
)"""
_META = """CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"""

# How long an append (or a probe) waits for SQLite's write lock before it is refused. Every
# request waits with it (the loop's thread), so it is short; an uncontended WAL commit takes
# well under a millisecond. Opening the log at start-up keeps SQLite's default (5 s).
APPEND_BUSY_TIMEOUT_S = 0.1


class EventLog:
    """An append-only log of ``(user, items, timestamps)`` appends (see the module docstring).
    ``refused_appends`` counts the appends SQLite refused; ``last_error`` says why the last
    write was refused, None once one succeeds."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = _hold(path.with_name(path.name + ".lock"))
        # built on one thread, written by the serving loop's (one writer at a time)
        self._db = sqlite3.connect(path, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        self._db.execute(_META)
        self._db.commit()
        self._db.execute(f"PRAGMA busy_timeout = {round(APPEND_BUSY_TIMEOUT_S * 1000)}")
        self.refused_appends = 0
        self.last_error: str | None = None

    def base(self) -> str | None:
        """The digest of the user base the appends were made on; None: not recorded."""
        row = self._db.execute("SELECT value FROM meta WHERE key = 'base'").fetchone()
        return None if row is None else str(row[0])

    def set_base(self, digest: str) -> None:
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('base', ?)",
                             (digest,))

    def record(self, user_id: int, items: np.ndarray, timestamps: np.ndarray | None) -> None:
        """Write one append and commit it; ``HistoryStoreUnavailableError`` (nothing written)
        where SQLite refuses it (the file locked past ``APPEND_BUSY_TIMEOUT_S``, the disk
        full), counted in ``refused_appends``."""
        ts = None if timestamps is None else timestamps.astype("<i8").tobytes()
        try:
            with self._db:   # one transaction, committed on exit (rolled back on an error)
                self._db.execute(
                    "INSERT INTO events (user_id, items, timestamps) VALUES (?, ?, ?)",
                    (int(user_id), items.astype("<i8").tobytes(), ts))
        except sqlite3.Error as exc:
            self.refused_appends += 1
            self.last_error = f"the event log {self.path} refused the append ({exc})"
            raise HistoryStoreUnavailableError(self.last_error) from None
        self.last_error = None

    def unavailable(self) -> str | None:
        """None when the log takes writes; else why not. Only after a refused write: then it
        writes a probe row (``meta``'s ``probe``), waiting as an append does, and a probe that
        commits makes the log available again."""
        if self.last_error is None:
            return None
        try:
            with self._db:
                self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('probe', '')")
        except sqlite3.Error as exc:
            self.last_error = f"the event log {self.path} refuses writes ({exc})"
            return self.last_error
        self.last_error = None
        return None

    def replay(self) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """Every recorded append, oldest first."""
        rows = self._db.execute("SELECT user_id, items, timestamps FROM events ORDER BY seq")
        for user_id, items, ts in rows:
            yield (int(user_id), np.frombuffer(items, dtype="<i8").astype(np.int64),
                   None if ts is None else np.frombuffer(ts, dtype="<i8").astype(np.int64))

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM events").fetchone()[0])

    def close(self) -> None:
        self._db.close()
        self._lock.close()         # and with it the lock


def _hold(lock_path: Path) -> IO[bytes]:
    """An exclusive lock on ``lock_path``, held while the returned file is open:
    ``ConfigError`` where another process holds it. Two servers appending to one log would each
    serve their own events, and a restart would replay both merged (or refuse their timestamps
    half-way)."""
    handle = open(lock_path, "ab")   # noqa: SIM115 (held for the log's life, closed by close())
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ConfigError(f"the event log {lock_path.with_suffix('')} is held by another "
                          "process: one server appends to a log (share histories between "
                          "servers with --history-store redis://...)") from None
    return handle
