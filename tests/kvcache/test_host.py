"""HostKVTier: put/lookup, TTL, LRU eviction, refusals, pins under copy."""

from __future__ import annotations

import pytest
import torch

from relaygr.errors import ConfigError, InvalidInputError
from relaygr.kvcache import EntryState, HostKVTier, PrefixId, Refusal
from relaygr.kvcache.allocator import PageRun
from tests.kvcache.helpers import (
    LAYOUT,
    FakeClock,
    assert_kv_equal,
    make_host,
    make_kv,
    snapshot,
)


def test_put_then_lookup_returns_an_equal_copy() -> None:
    host = make_host(10)
    pid = PrefixId(3, 10, 9)
    kv = make_kv(pid)
    assert host.put(pid, kv)
    hit = host.lookup(3)
    assert hit is not None and hit.pid == pid
    assert_kv_equal(hit.kv, kv)
    assert hit.kv.k.data_ptr() != kv.k.data_ptr()              # a copy in the host arena
    assert host.info(3).state is EntryState.IDLE  # type: ignore[union-attr]
    assert host.lookup(4) is None
    assert host.stats.used_bytes == 3 * host.stats.page_bytes
    host.check_integrity()


def test_ttl_expiry() -> None:
    clock = FakeClock()
    host = make_host(10, clock, ttl_s=30.0)
    pid = PrefixId(3, 10, 9)
    host.put(pid, make_kv(pid))
    clock.advance(29.9)
    assert host.lookup(3) is not None and host.expire() == 0
    clock.advance(0.1)
    assert host.lookup(3) is None                              # expired: never returned
    assert host.acquire(pid) is None
    assert host.info(3) is None and host.stats.expired == 1    # acquire purged it
    assert host.stats.free_pages == 10
    host.check_integrity()


def test_stats_count_live_entries_only() -> None:
    """Expiry is lazy, but a snapshot is not behind it: an entry past its TTL is dropped
    before the figures are read, though nothing stored or acquired since."""
    clock = FakeClock()
    host = make_host(10, clock, ttl_s=30.0)
    pid = PrefixId(3, 10, 9)
    host.put(pid, make_kv(pid))
    stats = host.stats
    assert (stats.idle, stats.used_bytes, stats.expired) == (1, 3 * stats.page_bytes, 0)
    clock.advance(30.0)
    stats = host.stats
    assert (stats.idle, stats.used_bytes, stats.free_pages, stats.expired) == (0, 0, 10, 1)
    assert host.info(3) is None
    host.check_integrity()


def test_storing_the_same_pid_again_copies_nothing_and_restarts_the_ttl() -> None:
    clock = FakeClock()
    host = make_host(10, clock, ttl_s=30.0)
    pid = PrefixId(3, 10, 9)
    host.put(pid, make_kv(pid))
    clock.advance(20.0)
    assert host.put(pid, make_kv(pid))
    assert host.stats.admitted == 1
    clock.advance(20.0)                                        # 40 s after the first store
    assert host.lookup(3) is not None
    clock.advance(10.0)
    assert host.expire() == 1
    host.check_integrity()


def test_lru_eviction_and_replacement() -> None:
    host = make_host(10)
    a, b, c = PrefixId(1, 12, 0), PrefixId(2, 12, 0), PrefixId(3, 12, 0)
    for pid in (a, b, c):
        assert host.put(pid, make_kv(pid))
    assert host.acquire(a) is not None
    host.release(a)                                            # a becomes most recent
    assert [e.pid for e in host.store.index.lru()] == [b, c, a]
    d = PrefixId(4, 12, 0)
    assert host.put(d, make_kv(d))                             # evicts b, takes its pages
    assert host.info(2) is None and host.info(4).pages == PageRun(3, 3)  # type: ignore[union-attr]
    a2 = PrefixId(1, 8, 1)
    assert host.put(a2, make_kv(a2))                           # replaces a's older prefix
    assert host.info(1).pid == a2 and host.info(1).pages == PageRun(0, 2)  # type: ignore[union-attr]
    stats = host.stats
    assert (stats.evictions, stats.replaced, stats.idle) == (1, 1, 3)
    assert_kv_equal(host.lookup(1).kv, make_kv(a2))  # type: ignore[union-attr]
    host.check_integrity()


def test_refusals_change_nothing() -> None:
    host = make_host(4)
    big = PrefixId(1, 20, 0)
    assert not host.put(big, make_kv(big))                     # 5 pages > 4
    assert host.last_refusal is Refusal.TOO_LARGE
    a = PrefixId(2, 16, 0)
    host.put(a, make_kv(a))
    assert host.acquire(a) is not None                         # being copied to a device
    before = snapshot(host.store)
    b = PrefixId(3, 4, 0)
    assert not host.put(b, make_kv(b))
    assert host.last_refusal is Refusal.NO_SPACE and snapshot(host.store) == before
    a2 = PrefixId(2, 4, 1)
    assert not host.put(a2, make_kv(a2))                       # a is pinned: not replaced
    assert host.last_refusal is Refusal.USER_BUSY and snapshot(host.store) == before
    assert host.stats.admission_failures == 3
    host.check_integrity()


def test_a_pinned_entry_outlives_its_ttl_until_released() -> None:
    clock = FakeClock()
    host = make_host(10, clock, ttl_s=10.0)
    pid = PrefixId(1, 8, 0)
    host.put(pid, make_kv(pid))
    view = host.acquire(pid)
    assert view is not None
    clock.advance(11.0)
    assert host.expire() == 0 and host.lookup(1) is None       # not returned, not freed
    assert_kv_equal(view, make_kv(pid))                        # the copy source is intact
    assert host.acquire(pid) is None                           # nobody new gets it
    host.release(pid)
    assert host.expire() == 1 and host.info(1) is None
    host.check_integrity()


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        HostKVTier(LAYOUT, 10_000, ttl_s=0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            HostKVTier(LAYOUT, 10_000, ttl_s=1.0, pin_memory=True)
    host = make_host(10)
    with pytest.raises(InvalidInputError):
        host.put(PrefixId(1, 9, 0), make_kv(PrefixId(1, 8, 0)))
    with pytest.raises(InvalidInputError):
        host.put("user", make_kv(PrefixId(1, 8, 0)))  # type: ignore[arg-type]
    assert host.stats.entries == 0
