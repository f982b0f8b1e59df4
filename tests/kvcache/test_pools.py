"""KVArena and KVLayout: exact sizing within the budget, copies in, zero-copy views out."""

from __future__ import annotations

import pytest
import torch

from relaygr.errors import ConfigError, IncompatiblePrefixError, InvalidInputError
from relaygr.kvcache import KVLayout, PrefixId
from relaygr.kvcache.pools import KVArena, copy_blocks, slice_tokens
from relaygr.model import HSTUConfig, PrefixKV
from tests.kvcache.helpers import LAYOUT, PAGE_BYTES, assert_kv_equal, make_kv


def test_page_bytes_count_kv_timestamps_and_hidden_slot() -> None:
    assert LAYOUT.kv_token_bytes + 8 == PrefixKV.bytes_per_token(2, 8, torch.float32, True)
    assert LAYOUT.page_bytes(4) == PAGE_BYTES == 4 * 136 + 32
    cfg = HSTUConfig(num_items=10, dim=32, num_layers=3, num_heads=4)
    assert KVLayout.for_model(cfg, torch.bfloat16) == KVLayout(3, 4, 8, torch.bfloat16)


def test_arena_fills_the_budget_with_whole_pages_and_nothing_more() -> None:
    arena = KVArena(LAYOUT, 10 * PAGE_BYTES + PAGE_BYTES - 1, page_tokens=4)
    assert arena.num_pages == 10 and arena.capacity_tokens == 40
    assert arena.arena_bytes == 10 * PAGE_BYTES == arena.allocated_bytes()
    assert arena.k.shape == (2, 2, 40, 4) and arena.last_hidden.shape == (10, 8)
    assert arena.timestamps.dtype == torch.int64 and not arena.is_pinned


@pytest.mark.parametrize(("budget", "page_tokens"), [(PAGE_BYTES - 1, 4), (10_000, 0),
                                                     (-1, 4), (10_000, 2.5)])
def test_bad_sizes_are_config_errors(budget: int, page_tokens: int) -> None:
    with pytest.raises(ConfigError):
        KVArena(LAYOUT, budget, page_tokens)


def test_bad_layouts_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        KVLayout(0, 2, 4)
    with pytest.raises(ConfigError):
        KVLayout(2, 2, 4, torch.int32)


def test_write_then_view_round_trips_and_views_alias_the_arena() -> None:
    arena = KVArena(LAYOUT, 10 * PAGE_BYTES, page_tokens=4)
    kv = make_kv(PrefixId(1, 7, 3))
    arena.write(2, kv, 0, timed=True)
    view = arena.view(2, 7, timed=True)
    assert_kv_equal(view, kv)
    assert view.k.data_ptr() == arena.k[:, :, 8].data_ptr()      # page 2 starts at token 8
    assert view.k.stride(-1) == 1 and view.timestamps is not None
    assert view.last_hidden.data_ptr() == arena.last_hidden[2].data_ptr()
    assert arena.view(2, 7, timed=False).timestamps is None


def test_write_at_an_offset_and_slice_tokens() -> None:
    arena = KVArena(LAYOUT, 10 * PAGE_BYTES, page_tokens=4)
    kv = make_kv(PrefixId(1, 9, 0))
    assert kv.timestamps is not None
    head = PrefixKV(kv.k[:, :, :5], kv.v[:, :, :5], kv.timestamps[:5], kv.last_hidden * 0)
    arena.write(0, head, 0, timed=True)
    arena.write(0, slice_tokens(kv, 5), 5, timed=True)
    assert_kv_equal(arena.view(0, 9, timed=True), kv)


def test_layout_check_and_timestamp_mismatch() -> None:
    arena = KVArena(LAYOUT, 10 * PAGE_BYTES, page_tokens=4)
    other = make_kv(PrefixId(1, 4, 0), layout=KVLayout(2, 2, 4, torch.float64))
    with pytest.raises(IncompatiblePrefixError, match="dtype"):
        LAYOUT.check(other)
    with pytest.raises(IncompatiblePrefixError, match="layers"):
        LAYOUT.check(make_kv(PrefixId(1, 4, 0), layout=KVLayout(3, 2, 4)))
    before = arena.k.clone()
    with pytest.raises(InvalidInputError, match="timestamps"):
        arena.write(0, make_kv(PrefixId(1, 4, 0), timed=False), 0, timed=True)
    assert torch.equal(arena.k, before)


def test_block_copies_equal_one_strided_copy() -> None:
    """The per-(layer, head) path that cross-device copies take gives the same bytes."""
    src = torch.randn(2, 3, 5, 4)
    expected = torch.zeros(2, 3, 20, 4)
    expected[:, :, 7:12] = src
    for per_block in (True, False, None):
        arena = torch.zeros(2, 3, 20, 4)
        copy_blocks(arena[:, :, 7:12], src, per_block=per_block)
        assert torch.equal(arena, expected)
    assert arena[1, 2, 7:12].is_contiguous()                  # each block: one DMA on CUDA


def test_malformed_prefixes_and_hidden_vectors_are_refused_not_cast() -> None:
    """A copy into the arena would cast float timestamps or another dtype's hidden vector
    without a word: they are refused, as malformed K/V shapes are (typed, under -O too)."""
    kv = make_kv(PrefixId(1, 8, 7))
    assert kv.timestamps is not None
    with pytest.raises(IncompatiblePrefixError, match="int64 seconds"):
        PrefixKV(kv.k, kv.v, kv.timestamps.double(), kv.last_hidden)
    with pytest.raises(IncompatiblePrefixError, match="int64 seconds"):
        PrefixKV(kv.k, kv.v, kv.timestamps[:3], kv.last_hidden)
    with pytest.raises(IncompatiblePrefixError, match="one \\[layers, heads, tokens, head_dim\\]"):
        PrefixKV(kv.k[0], kv.v[0], None, kv.last_hidden)
    with pytest.raises(IncompatiblePrefixError, match="one \\[layers, heads, tokens, head_dim\\]"):
        PrefixKV(kv.k, kv.v[:, :, :4], None, kv.last_hidden)
    wrong_hidden = PrefixKV(kv.k, kv.v, kv.timestamps, kv.last_hidden.to(torch.int64))
    with pytest.raises(IncompatiblePrefixError, match=r"last_hidden is torch\.int64"):
        LAYOUT.check(wrong_hidden)
    arena = KVArena(LAYOUT, 4 * PAGE_BYTES, page_tokens=4)
    with pytest.raises(IncompatiblePrefixError, match=r"last_hidden is torch\.float64"):
        arena.write_hidden(0, kv.last_hidden.double())
    assert torch.count_nonzero(arena.last_hidden) == 0
