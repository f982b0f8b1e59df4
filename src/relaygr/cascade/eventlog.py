"""Appended events on disk, so that a restart loses no event the server acknowledged.

The served users' histories are built at start-up from the dataset; what arrives while serving
(``/v1/events``, and the recent items of every visit, appended after ranking) lives in the
``HistoryStore`` and, once ``InMemoryHistoryStore.persist_to`` is on, also in an ``EventLog``:
one SQLite database in WAL mode (standard library, one writer, the serving event loop's
thread). An append is written and committed before the store returns, so before the request is
answered; ``synchronous=NORMAL`` makes a commit survive the process's death (an operating
system crash may lose the last few). At start-up the log is replayed, in order, onto the
freshly built store: the histories, and therefore every prefix version, are what they were.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import numpy as np

_SCHEMA = """CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id INTEGER NOT NULL,
    items BLOB NOT NULL,
    timestamps BLOB
)"""


class EventLog:
    """An append-only log of ``(user, items, timestamps)`` appends (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # built on one thread, written by the serving loop's (one writer at a time)
        self._db = sqlite3.connect(path, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        self._db.commit()

    def record(self, user_id: int, items: np.ndarray, timestamps: np.ndarray | None) -> None:
        """Write one append and commit it."""
        ts = None if timestamps is None else timestamps.astype("<i8").tobytes()
        with self._db:   # one transaction, committed on exit
            self._db.execute("INSERT INTO events (user_id, items, timestamps) VALUES (?, ?, ?)",
                             (int(user_id), items.astype("<i8").tobytes(), ts))

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
