"""The cache on CUDA: device arena in GPU memory, pinned host tier, side-stream copies."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relaygr.kvcache import (
    DeviceKVPool,
    EntryState,
    Expander,
    HostKVTier,
    KVLayout,
    PrefixId,
    ReloadOutcome,
)
from tests.kvcache.helpers import assert_kv_equal
from tests.model.helpers import assert_close, make_model, random_history

pytestmark = pytest.mark.gpu


def cuda_tiers(model: torch.nn.Module, pages: int = 40) -> Expander:
    layout = KVLayout.for_model(model.cfg)  # type: ignore[arg-type]
    budget = pages * layout.page_bytes(16)
    pool = DeviceKVPool(layout, budget, page_tokens=16, device="cuda")
    host = HostKVTier(layout, budget, ttl_s=60.0, page_tokens=16, pin_memory=True)
    return Expander(pool, host)


def test_arena_lives_on_the_gpu_and_the_host_tier_is_pinned() -> None:
    model = make_model(41).to("cuda")
    ex = cuda_tiers(model)
    assert ex.pool.store.arena.k.device.type == "cuda"
    assert ex.host.store.arena.is_pinned and ex.transfer.asynchronous
    ex.pool.check_integrity()
    ex.host.check_integrity()


def test_demote_then_reload_with_extension_on_a_side_stream() -> None:
    async def scenario() -> None:
        model = make_model(42).to("cuda")
        items, ts = random_history(torch.Generator().manual_seed(42), 300, 500, True)
        ex = cuda_tiers(model)
        base, target = PrefixId(1, 200, 1), PrefixId(1, 300, 2)
        kv = model.prefill(items[:200], ts[:200])
        pending = ex.pool.begin(base, timed=True)
        assert pending is not None
        ex.pool.write(pending, kv)
        ex.pool.commit(pending)
        assert ex.pool.acquire(base) is not None
        assert await ex.release(base) is True                   # D2H on the side stream
        hit = ex.host.lookup(1)
        assert hit is not None and hit.kv.k.is_pinned()
        assert_kv_equal(hit.kv, kv.to("cpu"))

        async def extend(past):  # type: ignore[no-untyped-def]
            return model.prefill(items[200:300], ts[200:300], past=past)

        outcome = await ex.reload(target, base, extend)         # H2D on the side stream
        assert outcome is ReloadOutcome.LOADED
        assert ex.pool.lookup(1).state is EntryState.READY  # type: ignore[union-attr]
        view = ex.pool.acquire(target)
        assert view is not None and view.device.type == "cuda"
        assert torch.equal(view.k[:, :, :200], kv.k)
        cands = torch.arange(1, 64)
        assert_close(model.rank(cands, prefix=view).cpu(),
                     model.rank(cands, prefix_items=items[:300],
                                prefix_timestamps=ts[:300]).cpu())
        ex.pool.release(target)
        ex.pool.check_integrity()
        ex.host.check_integrity()

    asyncio.run(scenario())
