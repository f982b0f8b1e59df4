"""DeviceKVPool: the pre-infer lifecycle with exact states, pages, leases and eviction order."""

from __future__ import annotations

import asyncio

import pytest

from relaygr.errors import CacheStateError, IncompatiblePrefixError, InvalidInputError
from relaygr.kvcache import EntryState, KVLayout, PrefixId, Refusal
from relaygr.kvcache.allocator import PageRun
from relaygr.kvcache.pools import slice_tokens
from tests.kvcache.helpers import (
    PAGE_BYTES,
    FakeClock,
    assert_kv_equal,
    consume,
    fill,
    head,
    make_kv,
    make_pool,
    snapshot,
)


def free_runs(pool) -> list[PageRun]:  # type: ignore[no-untyped-def]
    return pool.store.allocator.free_runs()


def lru(pool) -> list[PrefixId]:  # type: ignore[no-untyped-def]
    return [e.pid for e in pool.store.index.lru()]


def test_pre_infer_hit_lifecycle() -> None:
    clock = FakeClock(100.0)
    pool = make_pool(10, clock)
    pid = PrefixId(user_id=7, num_tokens=10, version=42)
    pending = pool.begin(pid, timed=True)
    assert pending is not None and pending.pid == pid
    info = pool.lookup(7)
    assert info is not None and info.state is EntryState.PENDING
    assert info.pages == PageRun(0, 3) and not info.in_use and info.lease_deadline_s is None
    assert free_runs(pool) == [PageRun(3, 7)]
    assert pool.acquire(pid) is None                          # PENDING is not served
    pool.check_integrity()

    kv = make_kv(pid)
    pool.write(pending, kv)
    clock.advance(0.5)
    pool.commit(pending, kv.last_hidden)
    info = pool.lookup(7)
    assert info is not None and info.state is EntryState.READY
    assert info.lease_deadline_s == 102.5 and lru(pool) == []
    pool.check_integrity()

    view = pool.acquire(pid)
    assert view is not None
    assert_kv_equal(view, kv)
    assert view.k.data_ptr() == pool.store.arena.k.data_ptr()  # zero-copy, page 0
    info = pool.lookup(7)
    assert info is not None and info.state is EntryState.READY and info.pins == 1
    stats = pool.stats
    assert (stats.ready, stats.in_use, stats.hits, stats.misses) == (1, 1, 1, 1)
    assert stats.used_bytes == stats.unevictable_bytes == 3 * PAGE_BYTES
    pool.check_integrity()

    pool.release(pid)
    info = pool.lookup(7)
    assert info is not None and info.state is EntryState.IDLE and info.pins == 0
    assert info.lease_deadline_s is None and lru(pool) == [pid]
    stats = pool.stats
    assert (stats.ready, stats.idle, stats.in_use, stats.unevictable_bytes) == (0, 1, 0, 0)
    assert (pool.used_bytes, pool.unevictable_bytes) == (3 * PAGE_BYTES, 0)
    pool.check_integrity()

    again = pool.acquire(pid)                                 # an IDLE entry is still a hit
    assert again is not None and lru(pool) == []
    pool.release(pid)
    assert pool.stats.hits == 2


def test_ranking_waits_for_pending_and_is_woken_by_commit() -> None:
    async def scenario() -> None:
        pool = make_pool(10)
        pid = PrefixId(1, 6, 5)
        pending = pool.begin(pid, timed=False)
        assert pending is not None
        waiters = [asyncio.ensure_future(pool.wait_settled(pid)) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiters)
        kv = make_kv(pid, timed=False)
        pool.write(pending, kv)
        pool.commit(pending)
        assert await asyncio.gather(*waiters) == [True, True, True]
        view = pool.acquire(pid)
        assert view is not None
        assert_kv_equal(view, kv)                              # hidden: from the write
        assert await pool.wait_settled(pid) is True           # settled: returns at once
        assert await pool.wait_settled(PrefixId(1, 6, 6)) is False
        pool.check_integrity()

    asyncio.run(scenario())


def test_abort_wakes_waiters_with_false_and_leaves_no_trace() -> None:
    async def scenario() -> None:
        pool = make_pool(10)
        pid = PrefixId(1, 6, 5)
        pending = pool.begin(pid, timed=True)
        assert pending is not None
        waiter = asyncio.ensure_future(pool.wait_settled(pid))
        await asyncio.sleep(0)
        pool.abort(pending)
        assert await waiter is False
        assert pool.lookup(1) is None and free_runs(pool) == [PageRun(0, 10)]
        assert pool.stats.aborted == 1 and pool.stats.entries == 0
        with pytest.raises(CacheStateError):
            pool.commit(pending)                               # the handle is dead
        pool.check_integrity()

    asyncio.run(scenario())


def test_lease_expiry_with_a_fake_clock() -> None:
    clock = FakeClock()
    pool = make_pool(6, clock, lease_s=2.0)
    a, b = PrefixId(1, 12, 0), PrefixId(2, 12, 0)             # 3 pages each: pool is full
    fill(pool, a)
    clock.advance(1.0)
    fill(pool, b)
    clock.advance(0.9)
    assert pool.expire_leases() == 0
    assert pool.begin(PrefixId(3, 4, 0), timed=True) is None  # both leased: refused
    assert pool.last_refusal is Refusal.NO_SPACE
    clock.advance(0.1)                                         # t = 2.0: a's lease ends
    assert pool.expire_leases() == 1
    info_a, info_b = pool.lookup(1), pool.lookup(2)
    assert info_a is not None and info_a.state is EntryState.IDLE
    assert info_b is not None and info_b.state is EntryState.READY
    clock.advance(5.0)                                         # b's lease ends; expired lazily
    pending = pool.begin(PrefixId(3, 4, 0), timed=True)       # evicts a (the older), not b
    assert pending is not None and pool.lookup(1) is None
    info_b = pool.lookup(2)
    assert info_b is not None and info_b.state is EntryState.IDLE
    assert pool.lookup(3).pages == PageRun(0, 1)  # type: ignore[union-attr]
    assert pool.stats.expired == 2 and pool.stats.evictions == 1
    pool.check_integrity()


def test_eviction_order_under_a_small_budget() -> None:
    pool = make_pool(10)
    a, b, c = PrefixId(1, 12, 0), PrefixId(2, 12, 0), PrefixId(3, 12, 0)
    for pid in (a, b, c):
        fill(pool, pid)
    assert [pool.lookup(u).pages for u in (1, 2, 3)] == [  # type: ignore[union-attr]
        PageRun(0, 3), PageRun(3, 3), PageRun(6, 3)]
    for pid in (b, a, c):                                      # consumed in this order
        consume(pool, pid)
    assert lru(pool) == [b, a, c]

    d = pool.begin(PrefixId(4, 12, 0), timed=True)            # 3 pages: the LRU (b) goes
    assert d is not None and pool.lookup(2) is None
    assert pool.lookup(4).pages == PageRun(3, 3)  # type: ignore[union-attr]
    assert lru(pool) == [a, c] and free_runs(pool) == [PageRun(9, 1)]

    e = pool.begin(PrefixId(5, 16, 0), timed=True)            # 4 pages: a, then c, considered
    assert e is not None
    # a's pages [0,3) cannot join [6,10), so only c is evicted; a survives
    assert pool.lookup(1) is not None and pool.lookup(3) is None
    assert pool.lookup(5).pages == PageRun(6, 4)  # type: ignore[union-attr]
    assert lru(pool) == [a] and free_runs(pool) == []
    assert pool.stats.evictions == 2
    pool.check_integrity()


def test_admission_fails_cleanly_instead_of_evicting_protected_entries() -> None:
    pool = make_pool(10)
    leased, used = PrefixId(1, 8, 0), PrefixId(2, 8, 0)
    fill(pool, leased)                                          # READY, leased: [0,2)
    fill(pool, used)                                            # in use: [2,4)
    assert pool.acquire(used) is not None
    pending = pool.begin(PrefixId(3, 8, 0), timed=True)        # PENDING: [4,6)
    idle = PrefixId(4, 16, 0)
    fill(pool, idle)                                            # [6,10)
    consume(pool, idle)                                         # IDLE: the only evictable
    before = snapshot(pool.store)
    assert pool.begin(PrefixId(5, 20, 0), timed=True) is None  # 5 pages: would need a protected
    assert pool.last_refusal is Refusal.NO_SPACE
    assert snapshot(pool.store) == before
    assert pending is not None and pool.stats.refusals[Refusal.NO_SPACE] == 1
    assert pool.begin(PrefixId(6, 44, 0), timed=True) is None  # 11 pages > arena
    assert pool.last_refusal is Refusal.TOO_LARGE and snapshot(pool.store) == before
    assert pool.stats.admission_failures == 2 and pool.stats.evictions == 0
    pool.check_integrity()


def test_fragmented_space_is_refused_not_half_evicted() -> None:
    pool = make_pool(10)
    pids = [PrefixId(u, 8, 0) for u in range(5)]               # 2 pages each, [0,2) .. [8,10)
    for pid in pids:
        fill(pool, pid)
        consume(pool, pid)
    for pid in (pids[1], pids[3]):
        assert pool.acquire(pid) is not None                   # pinned islands at 2 and 6
    before = snapshot(pool.store)
    assert pool.begin(PrefixId(9, 12, 0), timed=True) is None  # 6 evictable pages, none 3-long
    assert pool.last_refusal is Refusal.FRAGMENTED and snapshot(pool.store) == before
    pool.check_integrity()


def test_newer_version_replaces_the_users_entry_unless_it_is_busy() -> None:
    pool = make_pool(10)
    v1, v2, v3 = PrefixId(1, 8, 1), PrefixId(1, 12, 2), PrefixId(1, 12, 3)
    fill(pool, v1)
    with pytest.raises(CacheStateError, match="already cached"):
        pool.begin(v1, timed=True)
    assert pool.acquire(v1) is not None
    assert pool.begin(v2, timed=True) is None                  # v1 in use
    assert pool.last_refusal is Refusal.USER_BUSY
    pool.release(v1)
    pending = pool.begin(v2, timed=True)                       # v1 (IDLE) replaced
    assert pending is not None and pool.lookup(1).pid == v2  # type: ignore[union-attr]
    assert pool.stats.replaced == 1 and free_runs(pool) == [PageRun(3, 7)]
    assert pool.begin(v3, timed=True) is None                  # v2 PENDING
    assert pool.last_refusal is Refusal.USER_BUSY
    pool.check_integrity()


def test_stale_prefix_is_never_served() -> None:
    pool = make_pool(10)
    served = PrefixId(1, 8, 100)
    fill(pool, served)
    assert pool.acquire(PrefixId(1, 8, 101)) is None           # events changed
    assert pool.acquire(PrefixId(1, 9, 100)) is None           # longer prefix
    assert pool.acquire(PrefixId(2, 8, 100)) is None           # another user
    stats = pool.stats
    assert (stats.hits, stats.stale_misses, stats.misses) == (0, 2, 1)
    assert pool.lookup(1).pins == 0  # type: ignore[union-attr]


def test_write_in_two_parts_at_start_token() -> None:
    pool = make_pool(10)
    pid = PrefixId(1, 10, 0)
    kv = make_kv(pid)
    pending = pool.begin(pid, timed=True)
    assert pending is not None
    pool.write(pending, head(kv, 6))
    assert_kv_equal(pool.written_view(pending, 6), head(kv, 6))
    with pytest.raises(CacheStateError, match="6 of 10"):
        pool.commit(pending)
    pool.write(pending, slice_tokens(kv, 6), start_token=6)
    pool.commit(pending)
    view = pool.acquire(pid)
    assert view is not None
    assert_kv_equal(view, kv)


def test_misuse_raises_typed_errors_and_changes_nothing() -> None:
    pool = make_pool(10)
    pid = PrefixId(1, 8, 0)
    pending = pool.begin(pid, timed=True)
    assert pending is not None
    before = snapshot(pool.store)
    kv = make_kv(pid)
    wrong_layout = make_kv(pid, layout=KVLayout(3, 2, 4))
    with pytest.raises(IncompatiblePrefixError):
        pool.write(pending, wrong_layout)
    with pytest.raises(InvalidInputError, match="timestamps"):
        pool.write(pending, make_kv(pid, timed=False))
    with pytest.raises(InvalidInputError, match="gap"):
        pool.write(pending, slice_tokens(kv, 4), start_token=4)
    with pytest.raises(InvalidInputError, match="overflows"):
        pool.write(pending, make_kv(PrefixId(1, 9, 0)))
    with pytest.raises(InvalidInputError):
        pool.written_view(pending, 1)                          # nothing written yet
    with pytest.raises(CacheStateError):
        pool.release(pid)                                      # never acquired
    with pytest.raises(InvalidInputError):
        pool.begin((1, 8, 0), timed=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        PrefixId(1, 0, 0)
    assert snapshot(pool.store) == before
    pool.abort(pending)
    with pytest.raises(CacheStateError):
        pool.write(pending, kv)
    pool.check_integrity()


def test_several_pins_release_in_any_order() -> None:
    pool = make_pool(10)
    pid = PrefixId(1, 8, 0)
    fill(pool, pid)
    assert pool.acquire(pid) is not None and pool.acquire(pid) is not None
    pool.release(pid)
    info = pool.lookup(1)
    assert info is not None and info.state is EntryState.READY and info.pins == 1
    pool.release(pid)
    info = pool.lookup(1)
    assert info is not None and info.state is EntryState.IDLE and info.pins == 0
    with pytest.raises(CacheStateError):
        pool.release(pid)
    pool.check_integrity()


def test_commit_without_lease_is_idle_and_evictable_at_once() -> None:
    pool = make_pool(4)
    cached = PrefixId(1, 16, 0)                                # reactive: ranking already ran
    pending = pool.begin(cached, timed=False)
    assert pending is not None
    pool.write(pending, make_kv(cached, timed=False))
    pool.commit(pending, lease=False)
    info = pool.lookup(1)
    assert info is not None and info.state is EntryState.IDLE and lru(pool) == [cached]
    assert pool.unevictable_bytes == 0
    assert pool.begin(PrefixId(2, 4, 0), timed=False) is not None   # evicts it
    assert pool.lookup(1) is None and pool.stats.evictions == 1
    pool.check_integrity()


def test_discard_frees_only_a_complete_unheld_entry() -> None:
    pool = make_pool(10, FakeClock())
    pid = PrefixId(user_id=3, num_tokens=10, version=5)
    assert not pool.discard(pid)                              # absent
    fill(pool, pid)
    assert not pool.discard(pid)                              # READY: leased to its request
    assert pool.acquire(pid) is not None
    assert not pool.discard(pid)                              # in use
    pool.release(pid)
    assert not pool.discard(PrefixId(user_id=3, num_tokens=10, version=6))   # other version
    assert pool.discard(pid)                                  # IDLE and unheld: freed
    assert pool.lookup(3) is None and free_runs(pool) == [PageRun(0, 10)]
    pool.check_integrity()
