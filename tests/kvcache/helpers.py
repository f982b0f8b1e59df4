"""Cache-test helpers: a tiny layout, deterministic prefixes, a fake clock, state snapshots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relaygr.kvcache import DeviceKVPool, HostKVTier, KVLayout, PrefixId
from relaygr.kvcache.allocator import PageRun
from relaygr.kvcache.index import EntryInfo
from relaygr.kvcache.store import PagedStore
from relaygr.model import PrefixKV

# 2 layers x 2 heads x 4 dims, float32: 128 K/V bytes + 8 timestamp bytes per token.
LAYOUT = KVLayout(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float32)
PAGE_TOKENS = 4
PAGE_BYTES = PAGE_TOKENS * (128 + 8) + 8 * 4     # 576: four tokens and one hidden slot


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make_kv(pid: PrefixId, timed: bool = True, layout: KVLayout = LAYOUT) -> PrefixKV:
    """Deterministic contents for ``pid``: equal pids give equal data, others differ."""
    gen = torch.Generator().manual_seed(hash((pid.user_id, pid.num_tokens, pid.version)) % 2**31)
    shape = (layout.num_layers, layout.num_heads, pid.num_tokens, layout.head_dim)
    k = torch.randn(shape, generator=gen, dtype=layout.dtype)
    v = torch.randn(shape, generator=gen, dtype=layout.dtype)
    ts = 1_600_000_000 + torch.arange(pid.num_tokens) * 60 + pid.version if timed else None
    hidden = torch.randn(layout.dim, generator=gen, dtype=layout.dtype)
    return PrefixKV(k, v, ts, hidden)


def head(kv: PrefixKV, num_tokens: int) -> PrefixKV:
    """The first ``num_tokens`` of ``kv`` (same hidden)."""
    ts = None if kv.timestamps is None else kv.timestamps[:num_tokens]
    return PrefixKV(kv.k[:, :, :num_tokens], kv.v[:, :, :num_tokens], ts, kv.last_hidden)


def assert_kv_equal(actual: PrefixKV, expected: PrefixKV) -> None:
    assert torch.equal(actual.k, expected.k)
    assert torch.equal(actual.v, expected.v)
    assert torch.equal(actual.last_hidden, expected.last_hidden)
    if expected.timestamps is None:
        assert actual.timestamps is None
    else:
        assert actual.timestamps is not None
        assert torch.equal(actual.timestamps, expected.timestamps)


def make_pool(pages: int = 10, clock: FakeClock | None = None, lease_s: float = 2.0,
              slack_bytes: int = 0) -> DeviceKVPool:
    return DeviceKVPool(LAYOUT, pages * PAGE_BYTES + slack_bytes, page_tokens=PAGE_TOKENS,
                        lease_s=lease_s, clock=clock or FakeClock())


def make_host(pages: int = 10, clock: FakeClock | None = None, ttl_s: float = 60.0) -> HostKVTier:
    return HostKVTier(LAYOUT, pages * PAGE_BYTES, ttl_s, page_tokens=PAGE_TOKENS,
                      clock=clock or FakeClock())


@dataclass(frozen=True)
class Snapshot:
    """Everything observable about a store except its counters."""

    entries: tuple[EntryInfo, ...]
    lru: tuple[PrefixId, ...]
    free_runs: tuple[PageRun, ...]
    arena_k: torch.Tensor

    def __eq__(self, other: object) -> bool:
        assert isinstance(other, Snapshot)
        return (self.entries == other.entries and self.lru == other.lru
                and self.free_runs == other.free_runs and torch.equal(self.arena_k, other.arena_k))

    __hash__ = None  # type: ignore[assignment]


def snapshot(store: PagedStore) -> Snapshot:
    return Snapshot(tuple(EntryInfo.of(e) for e in store.index.entries()),
                    tuple(e.pid for e in store.index.lru()),
                    tuple(store.allocator.free_runs()), store.arena.k.clone())


def fill(pool: DeviceKVPool, pid: PrefixId, timed: bool = True) -> PrefixKV:
    """Pre-infer ``pid`` into ``pool`` (begin, write, commit): it ends READY and leased."""
    pending = pool.begin(pid, timed=timed)
    assert pending is not None, f"{pid} refused: {pool.last_refusal}"
    kv = make_kv(pid, timed)
    pool.write(pending, kv)
    pool.commit(pending, kv.last_hidden)
    return kv


def consume(pool: DeviceKVPool, pid: PrefixId) -> None:
    """A ranking request's use of a READY entry: acquire then release (-> IDLE)."""
    assert pool.acquire(pid) is not None
    pool.release(pid)
