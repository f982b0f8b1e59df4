"""Appended events survive a restart: the log replays onto the same base, versions and all."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import numpy as np
import pytest

from relaygr.cascade.eventlog import EventLog
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.errors import (
    ConfigError,
    HistoryStoreUnavailableError,
    InvalidInputError,
    ItemOutOfRangeError,
)
from relaygr.server import ServerConfig, build_embedded
from relaygr.server.build import load_model
from tests.engine.helpers import flops_cost_model
from tests.server.helpers import SOURCE, run_with_client, system_config

BASE = {1: (np.array([3, 4, 5]), None), 2: (np.array([7, 8]), np.array([100, 160]))}


def _store() -> InMemoryHistoryStore:
    return InMemoryHistoryStore.from_sequences(BASE, num_items=50)


def test_appends_are_replayed_onto_the_same_base(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    first = _store()
    assert first.persist_to(path) == 0
    first.append(1, [9, 10])
    first.append(2, [11], [200])
    first.append(3, [12, 13])                                  # a new user
    with pytest.raises(ItemOutOfRangeError):
        first.append(1, [51])                                  # refused: not recorded
    first.close()
    second = _store()
    assert second.persist_to(path) == 3
    for user in (1, 2, 3):
        a, b = first.get(user), second.get(user)
        assert a.items.tolist() == b.items.tolist() and a.version == b.version
        assert (a.timestamps is None) == (b.timestamps is None)
    timestamps = second.get(2).timestamps
    assert timestamps is not None
    assert timestamps.tolist() == [100, 160, 200]
    assert list(second) == [1, 2, 3]


def test_an_append_the_log_refuses_is_neither_served_nor_doubled_by_a_retry(
        tmp_path: Path) -> None:
    """The log is written first: where SQLite refuses an append (locked past its timeout, a
    full disk; here a second writer holds the database), the caller gets a typed error and
    the history is as it was, so the retry appends once and a restart replays what was
    served."""
    path = tmp_path / "events.sqlite"
    store = _store()
    store.persist_to(path)
    before = store.get(1)
    blocker = sqlite3.connect(path, timeout=0)
    blocker.execute("BEGIN IMMEDIATE")                     # a writer holding the database
    assert store._events is not None
    store._events._db.execute("PRAGMA busy_timeout = 0")   # fail at once, not in 5 s
    with pytest.raises(HistoryStoreUnavailableError, match="refused the append"):
        store.append(1, [9])
    with pytest.raises(HistoryStoreUnavailableError):
        store.append(4, [9])                               # a new user is not made either
    assert store.get(1).items.tolist() == before.items.tolist() and 4 not in store
    assert store.get(1).version == before.version
    blocker.rollback()
    blocker.close()
    store.append(1, [9])                                   # the retry
    served = store.get(1)
    store.close()
    replayed = _store()
    replayed.persist_to(path)
    assert replayed.get(1).items.tolist() == served.items.tolist() == [3, 4, 5, 9]
    assert replayed.get(1).version == served.version
    with pytest.raises(InvalidInputError, match="2\\^53-1"):
        replayed.append(2 ** 53, [9])


def test_a_closed_store_refuses_appends_rather_than_keeping_them_in_memory_only(
        tmp_path: Path) -> None:
    """``close`` lets the log go; an append after it (a request that outlived a timed-out drain)
    could not be written there, so it is refused with the typed 503 and nothing is held: an
    acknowledged append is one a restart replays."""
    path = tmp_path / "events.sqlite"
    store = _store()
    store.persist_to(path)
    store.append(1, [9])
    store.close()
    before = store.get(1)
    with pytest.raises(HistoryStoreUnavailableError, match="closed"):
        store.append(1, [10])
    with pytest.raises(HistoryStoreUnavailableError, match="closed"):
        store.append(4, [10])                              # nor is a new user made
    assert store.get(1).items.tolist() == before.items.tolist() == [3, 4, 5, 9]
    assert store.get(1).version == before.version and 4 not in store
    assert "closed" in (store.unavailable() or "")
    replayed = _store()
    assert replayed.persist_to(path) == 1
    assert replayed.get(1).items.tolist() == [3, 4, 5, 9]
    replayed.close()


def test_one_process_appends_to_a_log(tmp_path: Path) -> None:
    """A second server on the same log would serve its own events and a restart would replay
    both merged: it is refused until the first lets the log go."""
    path = tmp_path / "events.sqlite"
    first = _store()
    first.persist_to(path)
    first.append(1, [9])
    with pytest.raises(ConfigError, match="held by another process"):
        _store().persist_to(path)
    first.close()
    second = _store()
    assert second.persist_to(path) == 1
    second.close()


def test_a_log_is_never_replayed_onto_other_users(tmp_path: Path) -> None:
    """A log records the user base its appends were made on: a store of other users (here one
    more event for user 1: another dataset, synthetic users, another window) is refused with
    the log named, and neither the store nor the log changes; the same base replays."""
    path = tmp_path / "events.sqlite"
    first = _store()
    first.persist_to(path)
    first.append(1, [9, 10])
    first.close()
    other = InMemoryHistoryStore.from_sequences(
        {**BASE, 1: (np.array([3, 4, 5, 6]), None)}, num_items=50)
    with pytest.raises(ConfigError, match=f"the event log {path} holds 1 appends made on "
                                          "another user base"):
        other.persist_to(path)
    assert other.get(1).items.tolist() == [3, 4, 5, 6]
    again = _store()
    assert again.persist_to(path) == 1 and again.get(1).items.tolist() == [3, 4, 5, 9, 10]
    again.close()


def test_a_log_that_did_not_record_its_base_is_refused_once_it_holds_appends(
        tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    log = EventLog(path)                              # as an older relaygr wrote it: no base
    log.record(1, np.array([9]), None)
    log.close()
    with pytest.raises(ConfigError, match=r"a user base it did not record.*--events-adopt"):
        _store().persist_to(path)
    adopted = _store()
    assert adopted.persist_to(path, adopt=True) == 1          # taken as these users' appends
    adopted.close()
    assert _store().persist_to(path) == 1                     # and recorded as theirs since
    empty = tmp_path / "empty.sqlite"
    EventLog(empty).close()
    store = _store()
    assert store.persist_to(empty) == 0                    # nothing to misplace: adopted
    store.close()


def test_a_restarted_service_has_every_acknowledged_event(tmp_path: Path) -> None:
    source = SOURCE.__class__(**{**SOURCE.__dict__, "events": tmp_path / "events.sqlite"})
    cost = flops_cost_model(load_model(source).cfg)

    def serve_once(body):  # type: ignore[no-untyped-def]
        service = build_embedded(source, system_config(), ServerConfig(), cost)
        return service, run_with_client(service, body)

    async def write(client: httpx.AsyncClient) -> list[int]:
        sent = []
        t = 1_900_000_000                                       # after every synthetic event
        for user in (1, 2, 30):                                 # 30: a new user
            r = await client.post("/v1/events", json={"user_id": user, "items": [5, 6, 7],
                                                      "timestamps": [t, t + 1, t + 2]})
            assert r.status_code == 200, r.text
            sent.append(r.json()["num_events"])
        r = await client.post("/v1/recommend", json={
            "user_id": 1, "recent_items": [9], "recent_timestamps": [t + 10],
            "request_ts": t + 20})
        assert r.status_code == 200, r.text
        return sent

    async def read(client: httpx.AsyncClient) -> None:
        return None

    before, counts = serve_once(write)
    after, _ = serve_once(read)
    for user in (1, 2, 30):
        assert after.backend.store.get(user).items.tolist() == \
            before.backend.store.get(user).items.tolist()
    assert after.backend.store.num_events(30) == counts[2] == 3
    assert after.backend.store.get(1).items[-4:].tolist() == [5, 6, 7, 9]
