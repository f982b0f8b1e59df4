"""Zero-copy views of the device pool rank exactly like the PrefixKV they were copied from."""

from __future__ import annotations

import torch

from relaygr.kvcache import DeviceKVPool, KVLayout, PrefixId
from tests.model.helpers import assert_close, make_model, random_history


def test_views_into_the_arena_rank_like_the_original_prefix() -> None:
    model = make_model(31)
    layout = KVLayout.for_model(model.cfg)
    pool = DeviceKVPool(layout, 30 * layout.page_bytes(16), page_tokens=16)
    gen = torch.Generator().manual_seed(31)
    cands = torch.randint(1, 501, (37,), generator=gen)
    originals = {}
    for user, (length, timed) in enumerate([(45, True), (100, False), (17, True)]):
        items, ts = random_history(gen, length, 500, timed)
        kv = model.prefill(items, ts)
        pid = PrefixId(user, length, version=user)
        pending = pool.begin(pid, timed=timed)
        assert pending is not None
        pool.write(pending, kv)
        pool.commit(pending, kv.last_hidden)
        originals[pid] = (kv, items, ts)
    arena = pool.store.arena
    arena_bytes = arena.k.numel() * arena.k.element_size()
    for pid, (kv, items, ts) in originals.items():
        view = pool.acquire(pid)
        assert view is not None
        offset = view.k.data_ptr() - arena.k.data_ptr()
        assert 0 <= offset < arena_bytes and not view.k.is_contiguous()   # a view, not a copy
        suffix = torch.randint(1, 501, (5,), generator=gen)
        suffix_ts = None if ts is None else ts[-1] + torch.arange(1, 6)
        from_view = model.rank(cands, prefix=view, suffix_items=suffix,
                               suffix_timestamps=suffix_ts)
        from_kv = model.rank(cands, prefix=kv, suffix_items=suffix, suffix_timestamps=suffix_ts)
        full = model.rank(cands, prefix_items=items, prefix_timestamps=ts, suffix_items=suffix,
                          suffix_timestamps=suffix_ts)
        assert torch.equal(from_view, from_kv)
        assert_close(from_view, full)
        pool.release(pid)
    pool.check_integrity()
