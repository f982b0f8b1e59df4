"""Expander: demotion to the host, reload (deduplicated), extension with new events."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relaygr.errors import InvalidInputError
from relaygr.kvcache import (
    DeviceKVPool,
    EntryState,
    Expander,
    ExtendedPrefix,
    HostKVTier,
    KVLayout,
    PrefixId,
    ReloadOutcome,
)
from relaygr.kvcache.allocator import PageRun
from relaygr.model import PrefixKV, RankInput
from tests.kvcache.helpers import (
    FakeClock,
    assert_kv_equal,
    fill,
    make_host,
    make_kv,
    make_pool,
)
from tests.model.helpers import assert_close, make_model, random_history


def tiers(device_pages: int = 10, host_pages: int = 10) -> Expander:
    clock = FakeClock()
    return Expander(make_pool(device_pages, clock), make_host(host_pages, clock))


def test_release_demotes_to_the_host_and_keeps_the_device_copy() -> None:
    async def scenario() -> None:
        ex = tiers()
        pid = PrefixId(1, 10, 4)
        kv = fill(ex.pool, pid)
        assert ex.pool.acquire(pid) is not None
        assert await ex.release(pid) is True
        info = ex.pool.lookup(1)
        assert info is not None and info.state is EntryState.IDLE and info.pins == 0
        hit = ex.host.lookup(1)
        assert hit is not None and hit.pid == pid
        assert_kv_equal(hit.kv, kv)
        assert ex.pool.acquire(pid) is not None                # used again: no second copy
        assert await ex.release(pid) is True
        stats = ex.stats
        assert (stats.demotion_copies, stats.demotion_skips) == (1, 1)
        assert stats.demotion_bytes == kv.nbytes
        ex.pool.check_integrity()
        ex.host.check_integrity()

    asyncio.run(scenario())


def test_release_still_releases_when_the_host_refuses() -> None:
    async def scenario() -> None:
        ex = tiers(device_pages=10, host_pages=2)
        pid = PrefixId(1, 12, 0)                               # 3 pages: too large for host
        fill(ex.pool, pid)
        assert ex.pool.acquire(pid) is not None
        assert await ex.release(pid) is False
        assert ex.pool.lookup(1).pins == 0  # type: ignore[union-attr]
        assert ex.stats.demotion_refusals == 1 and ex.host.stats.entries == 0

    asyncio.run(scenario())


def test_host_hit_reloads_into_the_device_pool() -> None:
    async def scenario() -> None:
        ex = tiers()
        pid = PrefixId(2, 10, 8)
        kv = make_kv(pid)
        ex.host.put(pid, kv)
        assert await ex.reload(pid, pid) is ReloadOutcome.LOADED
        info = ex.pool.lookup(2)
        assert info is not None and info.state is EntryState.READY and info.pages == PageRun(0, 3)
        view = ex.pool.acquire(pid)
        assert view is not None
        assert_kv_equal(view, kv)
        assert ex.host.info(2).pins == 0  # type: ignore[union-attr]
        assert await ex.reload(pid, pid) is ReloadOutcome.ON_DEVICE
        assert ex.stats.reload_copies == 1 and ex.stats.on_device == 1
        ex.pool.check_integrity()
        ex.host.check_integrity()

    asyncio.run(scenario())


def test_misses_refusals_and_bad_arguments() -> None:
    async def scenario() -> None:
        ex = tiers(device_pages=3)
        old = PrefixId(2, 10, 8)
        ex.host.put(old, make_kv(old))
        newer = PrefixId(2, 10, 9)
        assert await ex.reload(newer, newer) is ReloadOutcome.HOST_MISS  # other version
        assert await ex.reload(PrefixId(3, 4, 0), PrefixId(3, 4, 0)) is ReloadOutcome.HOST_MISS
        fill(ex.pool, PrefixId(9, 12, 0))                      # device full, leased
        assert await ex.reload(old, old) is ReloadOutcome.REFUSED
        assert ex.host.info(2).pins == 0  # type: ignore[union-attr]
        with pytest.raises(InvalidInputError, match="give extend"):
            await ex.reload(PrefixId(2, 12, 1), old)
        with pytest.raises(InvalidInputError, match="another user"):
            await ex.reload(PrefixId(3, 12, 1), old)
        with pytest.raises(InvalidInputError, match="longer"):
            await ex.reload(PrefixId(2, 8, 1), old)
        stats = ex.stats
        assert (stats.host_misses, stats.refused, stats.reload_copies) == (2, 1, 0)
        ex.pool.check_integrity()

    asyncio.run(scenario())


def test_ttl_expired_host_entry_is_a_miss() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        ex = Expander(make_pool(10, clock), make_host(10, clock, ttl_s=5.0))
        pid = PrefixId(2, 10, 8)
        ex.host.put(pid, make_kv(pid))
        clock.advance(5.0)
        assert await ex.reload(pid, pid) is ReloadOutcome.HOST_MISS
        assert ex.pool.lookup(2) is None

    asyncio.run(scenario())


class CountingExtend:
    """An ``extend`` that computes the tail with the model and counts its calls."""

    def __init__(self, model, items, ts, start: int, yields: int = 3) -> None:  # type: ignore[no-untyped-def]
        self.model, self.items, self.ts, self.start = model, items, ts, start
        self.calls = 0
        self.yields = yields

    async def __call__(self, past: PrefixKV) -> PrefixKV:
        self.calls += 1
        for _ in range(self.yields):                           # let other requests run
            await asyncio.sleep(0)
        ts = None if self.ts is None else self.ts[self.start:]
        return self.model.prefill(self.items[self.start:], ts, past=past)


def model_tiers(model) -> Expander:  # type: ignore[no-untyped-def]
    layout = KVLayout.for_model(model.cfg)
    budget = 40 * layout.page_bytes(16)
    clock = FakeClock()
    pool = DeviceKVPool(layout, budget, page_tokens=16, clock=clock)
    host = HostKVTier(layout, budget, ttl_s=60.0, page_tokens=16, clock=clock)
    return Expander(pool, host)


@pytest.mark.parametrize("timed", [True, False])
def test_reload_and_extend_equals_prefilling_everything(timed: bool) -> None:
    async def scenario() -> None:
        model = make_model(21)
        items, ts = random_history(torch.Generator().manual_seed(21), 130, 500, timed)
        ex = model_tiers(model)
        base, target = PrefixId(5, 100, 1), PrefixId(5, 130, 2)
        base_kv = model.prefill(items[:100], None if ts is None else ts[:100])
        ex.host.put(base, base_kv)
        extend = CountingExtend(model, items[:130], ts, start=100)
        assert await ex.reload(target, base, extend) is ReloadOutcome.LOADED
        view = ex.pool.acquire(target)
        assert view is not None and view.num_tokens == 130 and extend.calls == 1
        assert torch.equal(view.k[:, :, :100], base_kv.k)      # the reloaded part, bit for bit
        full = model.prefill(items[:130], None if ts is None else ts[:130])
        assert_close(view.k, full.k)
        assert_close(view.v, full.v)
        assert_close(view.last_hidden, full.last_hidden)
        if ts is not None:
            assert view.timestamps is not None and torch.equal(view.timestamps, ts[:130])
        cands = torch.arange(1, 40)
        assert_close(model.rank(cands, prefix=view),
                     model.rank(cands, prefix_items=items[:130],
                                prefix_timestamps=None if ts is None else ts[:130]))
        ex.pool.check_integrity()

    asyncio.run(scenario())


def test_concurrent_reloads_of_one_user_share_one_load() -> None:
    async def scenario() -> None:
        model = make_model(22)
        items, ts = random_history(torch.Generator().manual_seed(22), 80, 500, True)
        ex = model_tiers(model)
        base, target = PrefixId(5, 64, 1), PrefixId(5, 80, 2)
        ex.host.put(base, model.prefill(items[:64], ts[:64]))
        extend = CountingExtend(model, items, ts, start=64)
        outcomes = await asyncio.gather(*(ex.reload(target, base, extend) for _ in range(5)))
        assert outcomes == [ReloadOutcome.LOADED] * 5
        stats = ex.stats
        assert (stats.reload_copies, stats.shared, extend.calls) == (1, 4, 1)
        assert ex.loading(5) is None
        assert await ex.reload(target, base, extend) is ReloadOutcome.ON_DEVICE
        assert ex.stats.reload_copies == 1

    asyncio.run(scenario())


def test_ranking_request_waits_for_a_reload_in_flight() -> None:
    async def scenario() -> None:
        model = make_model(23)
        items, ts = random_history(torch.Generator().manual_seed(23), 40, 500, True)
        ex = model_tiers(model)
        base, target = PrefixId(5, 32, 1), PrefixId(5, 40, 2)
        ex.host.put(base, model.prefill(items[:32], ts[:32]))
        load = asyncio.ensure_future(ex.reload(target, base, CountingExtend(
            model, items, ts, start=32)))
        await asyncio.sleep(0)                                 # the load has begun
        assert ex.loading(5) == target
        info = ex.pool.lookup(5)                               # what a ranking request sees
        assert info is not None and info.state is EntryState.PENDING and info.pid == target
        assert ex.pool.acquire(target) is None
        assert await ex.pool.wait_settled(target) is True      # woken by the reload's commit
        assert await load is ReloadOutcome.LOADED
        view = ex.pool.acquire(target)
        assert view is not None and view.num_tokens == 40
        assert ex.stats.reload_copies == 1

    asyncio.run(scenario())


def test_another_target_while_loading_is_busy_and_pending_is_reported() -> None:
    async def scenario() -> None:
        model = make_model(24)
        items, ts = random_history(torch.Generator().manual_seed(24), 40, 500, True)
        ex = model_tiers(model)
        base, target = PrefixId(5, 32, 1), PrefixId(5, 40, 2)
        ex.host.put(base, model.prefill(items[:32], ts[:32]))
        load = asyncio.ensure_future(ex.reload(target, base, CountingExtend(
            model, items, ts, start=32)))
        await asyncio.sleep(0)
        other = PrefixId(5, 36, 3)
        assert await ex.reload(other, base, CountingExtend(
            model, items, ts, start=32)) is ReloadOutcome.BUSY
        await load
        pre_infer = PrefixId(6, 16, 0)                         # a pre-infer in progress
        pending = ex.pool.begin(pre_infer, timed=True)
        assert pending is not None
        assert await ex.reload(pre_infer, pre_infer) is ReloadOutcome.PENDING
        assert (ex.stats.busy, ex.stats.pending) == (1, 1)

    asyncio.run(scenario())


def test_failed_extension_aborts_and_every_sharer_sees_the_error() -> None:
    async def scenario() -> None:
        ex = tiers()
        base, target = PrefixId(5, 8, 1), PrefixId(5, 12, 2)
        ex.host.put(base, make_kv(base))
        calls = 0

        async def broken(past: PrefixKV) -> PrefixKV:
            nonlocal calls
            calls += 1
            await asyncio.sleep(0)
            raise RuntimeError("pre-infer failed")

        results = await asyncio.gather(*(ex.reload(target, base, broken) for _ in range(3)),
                                       return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results) and calls == 1
        assert ex.pool.lookup(5) is None and ex.pool.stats.aborted == 1
        assert ex.host.info(5).pins == 0  # type: ignore[union-attr]
        assert ex.stats.failed == 1 and ex.loading(5) is None
        ex.pool.check_integrity()
        ex.host.check_integrity()

    asyncio.run(scenario())


def test_extension_of_the_wrong_length_is_rejected() -> None:
    async def scenario() -> None:
        ex = tiers()
        base, target = PrefixId(5, 8, 1), PrefixId(5, 12, 2)
        ex.host.put(base, make_kv(base))

        async def short(past: PrefixKV) -> PrefixKV:
            return make_kv(PrefixId(5, 3, 0))

        with pytest.raises(InvalidInputError, match="expected 4"):
            await ex.reload(target, base, short)
        assert ex.pool.lookup(5) is None

    asyncio.run(scenario())


def test_a_load_cancelled_before_it_ran_leaves_nothing_behind() -> None:
    async def scenario() -> None:
        ex = tiers()
        pid = PrefixId(5, 8, 1)
        ex.host.put(pid, make_kv(pid))
        outer = asyncio.ensure_future(ex.reload(pid, pid))
        await asyncio.sleep(0)                                 # reload began, the copy has not
        load = ex._inflight[5]
        assert not load.started and load.task is not None
        assert ex.pool.lookup(5).state is EntryState.PENDING  # type: ignore[union-attr]
        assert ex.host.info(5).pins == 1  # type: ignore[union-attr]
        load.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await asyncio.sleep(0)                                 # done-callbacks run
        assert ex.pool.lookup(5) is None and ex.host.info(5).pins == 0  # type: ignore[union-attr]
        assert ex.loading(5) is None and ex.stats.failed == 1
        ex.pool.check_integrity()
        ex.host.check_integrity()

    asyncio.run(scenario())


def test_release_can_demote_the_prefix_extended_by_the_ranked_suffix() -> None:
    async def scenario() -> None:
        model = make_model(25)
        items, ts = random_history(torch.Generator().manual_seed(25), 120, 500, True)
        ex = model_tiers(model)
        pid, longer = PrefixId(5, 100, 1), PrefixId(5, 120, 2)
        kv = model.prefill(items[:100], ts[:100])
        pending = ex.pool.begin(pid, timed=True)
        assert pending is not None
        ex.pool.write(pending, kv)
        ex.pool.commit(pending)
        view = ex.pool.acquire(pid)
        assert view is not None
        out = model.rank_batch_outputs([RankInput(
            torch.arange(1, 20), prefix=view, suffix_items=items[100:],
            suffix_timestamps=ts[100:])])[0]
        assert out.computed is not None and out.computed.num_tokens == 20
        # a bad extension is refused before the host changes, and the pin is released anyway:
        # the caller's ranking is over, and a pin kept would block the user's entry for good
        with pytest.raises(InvalidInputError, match="extended by 20"):
            await ex.release(pid, extended=ExtendedPrefix(PrefixId(5, 121, 2), out.computed))
        assert ex.pool.lookup(5).pins == 0 and ex.host.stats.entries == 0  # type: ignore[union-attr]
        assert ex.pool.acquire(pid) is not None
        assert await ex.release(pid, extended=ExtendedPrefix(longer, out.computed)) is True
        assert ex.pool.lookup(5).pins == 0  # type: ignore[union-attr]
        hit = ex.host.lookup(5)
        assert hit is not None and hit.pid == longer
        full = model.prefill(items, ts)
        assert torch.equal(hit.kv.k[:, :, :100], kv.k)
        assert_close(hit.kv.k, full.k)
        assert_close(hit.kv.v, full.v)
        assert_close(hit.kv.last_hidden, full.last_hidden)
        assert hit.kv.timestamps is not None and torch.equal(hit.kv.timestamps, ts)
        assert ex.stats.demotion_bytes == kv.nbytes + out.computed.nbytes
        ex.host.check_integrity()

    asyncio.run(scenario())
