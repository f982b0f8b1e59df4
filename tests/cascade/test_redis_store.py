"""The Redis history store: the in-memory store's contents, versions and errors, shared by
processes, appends atomic per user, an unreachable server a typed error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from relaygr.cascade.redis_store import RedisHistoryStore, check_store_url
from relaygr.cascade.store import HistoryStore, InMemoryHistoryStore
from relaygr.errors import (
    ConfigError,
    EmptyInputError,
    HistoryConflictError,
    HistoryStoreUnavailableError,
    InvalidInputError,
    ItemOutOfRangeError,
    TimestampError,
    UnknownUserError,
)
from tests.redis_server import RedisServer

SRC = Path(__file__).resolve().parents[2] / "src"


def _random_appends(seed: int, num_users: int = 12) -> list[tuple[int, np.ndarray, Any]]:
    """Chunked appends of random timed and untimed histories, users interleaved."""
    rng = np.random.default_rng(seed)
    appends = []
    for user in range(num_users):
        timed, clock = bool(user % 3), 1_000_000
        for _ in range(int(rng.integers(1, 6))):
            k = int(rng.integers(1, 40))
            items = rng.integers(1, 301, size=k)
            ts = None
            if timed:
                ts = clock + np.cumsum(rng.integers(0, 100, size=k))
                clock = int(ts[-1])
            appends.append((user * 7 + 1, items, ts))
    queues: dict[int, list[tuple[int, np.ndarray, Any]]] = {}
    for append in appends:                      # each user's appends, in their own order
        queues.setdefault(append[0], []).append(append)
    out = []
    for i in rng.permutation(len(appends)):     # users interleaved at random
        out.append(queues[appends[i][0]].pop(0))
    return out


def _versions(store: HistoryStore) -> dict[str, list[int]]:
    """Every user's versions of every prefix, and of windows from five starts each."""
    return {str(u): [store.version_at(u, n, s) for n in range(store.num_events(u) + 1)
                     for s in range(0, n + 1, max(1, n // 4))] for u in store}


@pytest.mark.parametrize("seed", [0, 1])
def test_contents_and_versions_equal_the_in_memory_stores(redis_url: str, seed: int) -> None:
    shared = RedisHistoryStore.connect(redis_url, num_items=300)
    memory = InMemoryHistoryStore(num_items=300)
    for user, items, ts in _random_appends(seed):
        a, b = shared.append(user, items, ts), memory.append(user, items, ts)
        assert a.items.tolist() == b.items.tolist() and a.version == b.version
    assert list(shared) == list(memory) and len(shared) == len(memory)
    assert _versions(shared) == _versions(memory)
    rng = np.random.default_rng(seed)
    for user in memory:
        n = memory.num_events(user)
        got, want = shared.get(user), memory.get(user)
        assert got.items.tolist() == want.items.tolist() and got.version == want.version
        assert (got.timestamps is None) == (want.timestamps is None)
        if want.timestamps is not None:
            assert got.timestamps is not None
            assert got.timestamps.tolist() == want.timestamps.tolist()
        cut = int(rng.integers(0, n + 1))
        assert shared.prefix(user, cut).items.tolist() == want.items[:cut].tolist()
        assert shared.prefix(user, cut).version == memory.prefix(user, cut).version
        start = int(rng.integers(0, cut + 1))
        extra = rng.integers(1, 301, size=3)
        extra_ts = None if want.timestamps is None else np.full(3, 2_000_000_000)
        assert shared.version_after(user, cut, extra, extra_ts, start) == \
            memory.version_after(user, cut, extra, extra_ts, start)
        with pytest.raises(ValueError):
            got.items[0] = 1                      # snapshots are read-only
    shared.check_integrity()


def test_another_process_derives_the_same_versions(redis_url: str) -> None:
    shared = RedisHistoryStore.connect(redis_url, num_items=300)
    memory = InMemoryHistoryStore(num_items=300)
    for user, items, ts in _random_appends(2, num_users=5):
        shared.append(user, items, ts)
        memory.append(user, items, ts)
    code = ("import json, sys; from relaygr.cascade.redis_store import RedisHistoryStore; "
            "from tests.cascade.test_redis_store import _versions; "
            "print(json.dumps(_versions(RedisHistoryStore.connect(sys.argv[1], 300))))")
    out = subprocess.run([sys.executable, "-c", code, redis_url], capture_output=True,
                         text=True, check=True, cwd=SRC.parent,
                         env={**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{SRC.parent}"})
    assert json.loads(out.stdout) == _versions(memory)


def _appender(url: str, user: int, tag: int, rounds: int) -> None:
    store = RedisHistoryStore.connect(url, num_items=1000)
    for r in range(rounds):
        store.append(user, [tag, tag, 100 + r])           # one append: three events together


def _check_whole_appends(store: RedisHistoryStore, user: int, tags: list[int],
                         rounds: int) -> None:
    """Every append of every appender is there once, its three events together, in order."""
    items = store.get(user).items.reshape(-1, 3).tolist()
    assert len(items) == len(tags) * rounds
    for tag in tags:
        mine = [row for row in items if row[0] == tag]
        assert mine == [[tag, tag, 100 + r] for r in range(rounds)]
    memory = InMemoryHistoryStore(1000)
    for row in items:
        memory.append(user, row)
    assert _versions(store) == _versions(memory)
    store.check_integrity()


def test_concurrent_appenders_never_interleave_or_lose_events(redis_url: str) -> None:
    tags, rounds = [1, 2, 3, 4], 40
    threads = [threading.Thread(target=_appender, args=(redis_url, 5, tag, rounds))
               for tag in tags]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _check_whole_appends(RedisHistoryStore.connect(redis_url, 1000), 5, tags, rounds)


def test_appenders_in_other_processes_share_one_history(redis_url: str) -> None:
    tags, rounds = [7, 8], 30
    code = ("import sys; from tests.cascade.test_redis_store import _appender; "
            "_appender(sys.argv[1], 9, int(sys.argv[2]), int(sys.argv[3]))")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{SRC.parent}"}
    procs = [subprocess.Popen([sys.executable, "-c", code, redis_url, str(tag), str(rounds)],
                              cwd=SRC.parent, env=env) for tag in tags]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    _check_whole_appends(RedisHistoryStore.connect(redis_url, 1000), 9, tags, rounds)


def test_an_append_that_loses_the_race_reads_again_and_lands_after_the_winner(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RedisHistoryStore.connect(redis_url, num_items=100)
    rival = RedisHistoryStore.connect(redis_url, num_items=100)
    store.append(1, [1, 2], [10, 11])
    read = store._sums
    calls: list[Any] = []

    def read_then_rival_appends(user_id: int, *counts: int) -> Any:
        state = read(user_id, *counts)
        if counts == (-1,) and not calls:
            calls.append(state)
            rival.append(1, [3], [12])                  # lands between our read and our write
        return state

    monkeypatch.setattr(store, "_sums", read_then_rival_appends)
    got = store.append(1, [4, 5], [12, 13])
    assert got.items.tolist() == [1, 2, 3, 4, 5] and calls[0].length == 2
    memory = InMemoryHistoryStore.from_sequences({1: ([1, 2, 3, 4, 5], [10, 11, 12, 12, 13])})
    assert got.version == memory.get(1).version == store.version_at(1, 5)
    monkeypatch.undo()
    with pytest.raises(TimestampError):   # checked against the winner's newest event
        store.append(1, [6], [11])
    store.check_integrity()


def test_an_append_whose_expected_count_a_rival_changed_is_refused_whole(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``expected_events`` is compared with the count the compare-and-set writes against: a
    rival append landing between the read and the write makes the precondition false, and
    nothing of ours is written (a retry of an append that did land finds it the same way)."""
    store = RedisHistoryStore.connect(redis_url, num_items=100)
    rival = RedisHistoryStore.connect(redis_url, num_items=100)
    store.append(1, [1, 2], [10, 11])
    read = store._sums

    def read_then_rival_appends(user_id: int, *counts: int) -> Any:
        state = read(user_id, *counts)
        if counts == (-1,) and state.length == 2:
            rival.append(1, [3], [12])                  # lands between our read and our write
        return state

    monkeypatch.setattr(store, "_sums", read_then_rival_appends)
    with pytest.raises(HistoryConflictError, match="user 1 has 3 events, not the 2") as caught:
        store.append(1, [4], [13], expected_events=2)
    assert (caught.value.num_events, caught.value.expected_events) == (3, 2)
    monkeypatch.undo()
    assert store.get(1).items.tolist() == [1, 2, 3]
    assert store.append(1, [4], [13], expected_events=3).items.tolist() == [1, 2, 3, 4]
    with pytest.raises(HistoryConflictError):
        store.append(1, [4], [13], expected_events=3)   # the retry: applied once
    assert store.append(7, [5], expected_events=0).items.tolist() == [5]    # a new user
    store.check_integrity()


def _base(store: HistoryStore) -> HistoryStore:
    store.append(1, [3, 4], [10, 20])
    store.append(2, [5])
    return store


ERRORS: list[tuple[str, Callable[[HistoryStore], object], type[Exception]]] = [
    ("unknown user get", lambda s: s.get(99), UnknownUserError),
    ("unknown user version", lambda s: s.version_at(99, 0), UnknownUserError),
    ("unknown user count", lambda s: s.num_events(99), UnknownUserError),
    ("unknown user prefix", lambda s: s.prefix(99, 0), UnknownUserError),
    ("negative user", lambda s: s.append(-1, [1]), InvalidInputError),
    ("bool user", lambda s: s.get(True), InvalidInputError),
    ("empty append", lambda s: s.append(1, [], []), EmptyInputError),
    ("item 0", lambda s: s.append(2, [0]), ItemOutOfRangeError),
    ("item past catalogue", lambda s: s.append(2, [101]), ItemOutOfRangeError),
    ("2-D items", lambda s: s.append(2, [[1]]), InvalidInputError),
    ("float items", lambda s: s.append(2, [1.5]), InvalidInputError),
    ("untimed append to timed", lambda s: s.append(1, [1]), TimestampError),
    ("timed append to untimed", lambda s: s.append(2, [1], [5]), TimestampError),
    ("timestamps short", lambda s: s.append(1, [1, 2], [30]), TimestampError),
    ("time goes back", lambda s: s.append(1, [1], [19]), TimestampError),
    ("time goes back within", lambda s: s.append(3, [1, 2], [9, 8]), TimestampError),
    ("count past length", lambda s: s.version_at(1, 3), InvalidInputError),
    ("negative count", lambda s: s.version_at(1, -1), InvalidInputError),
    ("float count", lambda s: s.prefix(1, 1.0), InvalidInputError),  # type: ignore[arg-type]
    ("prefix past length", lambda s: s.prefix(1, 3), InvalidInputError),
    ("start past count", lambda s: s.version_at(1, 1, 2), InvalidInputError),
    ("negative start", lambda s: s.version_at(1, 2, -1), InvalidInputError),
    ("after: untimed suffix", lambda s: s.version_after(1, 2, [1]), TimestampError),
    ("after: count past length", lambda s: s.version_after(2, 2, [1]), InvalidInputError),
    ("expected count stale", lambda s: s.append(1, [1], [5], expected_events=1),
     HistoryConflictError),                    # before the timestamps: a retry's are stale
    ("expected count of a new user", lambda s: s.append(3, [1], expected_events=2),
     HistoryConflictError),
    ("expected count negative", lambda s: s.append(2, [1], expected_events=-1),
     InvalidInputError),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_errors_are_the_in_memory_stores_and_change_nothing(
        redis_url: str, case: tuple[str, Callable[[HistoryStore], object], type[Exception]]
        ) -> None:
    _, call, error = case
    stores = [_base(InMemoryHistoryStore(100)), _base(RedisHistoryStore.connect(redis_url, 100))]
    messages = []
    for store in stores:
        with pytest.raises(error) as caught:
            call(store)
        assert type(caught.value) is error
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert _versions(stores[0]) == _versions(stores[1]) and 3 not in stores[1]
    assert -1 not in stores[1] and "1" not in stores[1]


def test_add_absent_adds_only_users_the_store_does_not_hold(redis_url: str) -> None:
    store = RedisHistoryStore.connect(redis_url, num_items=100)
    store.append(1, [9], [5])
    added = store.add_absent({1: ([1, 2], [1, 2]), 2: ([3, 4], [3, 4]), 3: ([5], None)})
    assert added == 2 and list(store) == [1, 2, 3]
    assert store.get(1).items.tolist() == [9] and store.get(2).items.tolist() == [3, 4]
    second = RedisHistoryStore.connect(redis_url, num_items=100)       # another server
    assert second.add_absent({1: ([1], [1]), 2: ([1], [1]), 4: ([7], [7])}) == 1
    assert list(store) == [1, 2, 3, 4] and store.get(2).items.tolist() == [3, 4]
    with pytest.raises(ItemOutOfRangeError):        # checked whole before anything is written
        store.add_absent({5: ([1], None), 6: ([101], None)})
    assert 5 not in store
    store.check_integrity()


def test_a_user_whose_keys_were_torn_apart_is_refused_never_given_its_old_version(
        redis_url: str) -> None:
    """A key lost to an eviction, expiry or DEL: the old sums would give a new history the old
    history's version, under which the cache holds the old K/V. Every read and append of such a
    user is refused, typed, and writes nothing."""
    store = RedisHistoryStore.connect(redis_url, num_items=100)
    store.append(7, [1, 2, 3])
    store.append(8, [4, 5], [10, 20])
    client = store._client
    client.delete("relaygr:user:7:items")                 # the sums stay behind
    client.delete("relaygr:user:8:sums")
    calls: list[Callable[[int], object]] = [
        lambda u: store.append(u, [50, 60, 70]), store.get, lambda u: store.version_at(u, 1),
        store.num_events, lambda u: store.prefix(u, 1),
        lambda u: store.add_absent({u: ([9], None)})]
    for user in (7, 8):
        for call in calls:
            with pytest.raises(HistoryStoreUnavailableError, match="disagree"):
                call(user)
    assert client.strlen("relaygr:user:7:items") == 0 and client.lrange("relaygr:users", 0, -1) \
        == [b"7", b"8"]                                   # nothing written, not listed twice


def test_a_store_of_another_catalogue_is_refused(redis_url: str) -> None:
    RedisHistoryStore.connect(redis_url, num_items=100)
    with pytest.raises(ConfigError, match="catalogue of 100 items"):
        RedisHistoryStore.connect(redis_url, num_items=200)
    RedisHistoryStore.connect(redis_url, num_items=200, namespace="other")


def test_an_unreachable_server_is_a_typed_error_never_a_torn_history(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    store = RedisHistoryStore.connect(server.url, num_items=100, timeout_s=2.0)
    store.append(1, [1, 2])
    server.stop()
    for call in (lambda: store.get(1), lambda: store.append(1, [3]), lambda: 1 in store,
                 lambda: store.version_at(1, 1), lambda: len(store), lambda: list(store),
                 lambda: store.add_absent({2: ([1], None)})):
        with pytest.raises(HistoryStoreUnavailableError, match="history store at redis://"):
            call()
    with pytest.raises(HistoryStoreUnavailableError):
        RedisHistoryStore.connect(server.url, num_items=100, timeout_s=2.0)


@pytest.mark.parametrize("url", ["localhost:6379", "http://host:1", "redis://", "", "memory"])
def test_a_store_url_must_name_a_redis_server(url: str) -> None:
    with pytest.raises(ConfigError, match="redis://HOST:PORT"):
        check_store_url(url)
    assert check_store_url("redis://127.0.0.1:6379/2") == "redis://127.0.0.1:6379/2"
