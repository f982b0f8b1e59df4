"""The fused attention kernel computes the eager reference's function, and falls back visibly.

These tests compile the kernel once per test session (seconds with inductor's on-disk cache);
the shapes are small and the tile size is tiny, so that every block spans several key tiles.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from relaygr.errors import ConfigError
from relaygr.model import HSTU, HSTUConfig, PrefillInput
from relaygr.model import fused as fused_module
from relaygr.model.fused import EagerAttention, FusedAttention
from tests.model.helpers import assert_close, make_model, random_history

# 2 heads x 64-key tiles: every block of more than 64 keys is split into tiles
TINY_TILES = 2 * 64


def _pair(**overrides: object) -> tuple[HSTU, HSTU]:
    fused = make_model(attention="fused", attention_tile_elems=TINY_TILES, num_heads=2,
                       **overrides)
    eager = make_model(attention="eager", num_heads=2, **overrides)
    eager.load_state_dict(fused.state_dict())
    return fused, eager


@pytest.mark.parametrize(("length", "suffix", "timed"),
                         [(1, 0, False), (130, 0, False), (301, 7, False), (301, 7, True)])
def test_fused_equals_eager_on_every_pass(length: int, suffix: int, timed: bool) -> None:
    fused, eager = _pair()
    assert fused.describe_attention().startswith("fused")
    gen = torch.Generator().manual_seed(length)
    items, ts = random_history(gen, length + suffix, 500, timed)
    cands = torch.randint(1, 501, (45,), generator=gen)
    query_ts = None if ts is None else int(ts[-1]) + 60
    prefix, prefix_ts = items[:length], None if ts is None else ts[:length]
    rest: dict[str, Any] = {
        "suffix_items": items[length:] if suffix else None,
        "suffix_timestamps": ts[length:] if ts is not None and suffix else None,
        "query_timestamp": query_ts}
    kv_fused, kv_eager = fused.prefill(prefix, prefix_ts), eager.prefill(prefix, prefix_ts)
    assert_close(kv_fused.k, kv_eager.k)
    assert_close(kv_fused.v, kv_eager.v)
    full = eager.rank(cands, prefix_items=prefix, prefix_timestamps=prefix_ts, **rest)
    assert_close(fused.rank(cands, prefix_items=prefix, prefix_timestamps=prefix_ts, **rest),
                 full)
    assert_close(fused.rank(cands, prefix=kv_fused, **rest), full)


def test_warm_up_leaves_the_kernel_and_the_scores_as_they_were() -> None:
    fused, eager = _pair()
    kernel = fused.attention_kernel
    assert fused.warm_up() == "fused (torch.compile, inductor CPU)"
    assert fused.attention_kernel is kernel
    cands = torch.arange(1, 30)
    items = torch.arange(1, 200)
    assert_close(fused.rank(cands, prefix_items=items), eager.rank(cands, prefix_items=items))


def test_where_compilation_fails_the_kernel_runs_eager_and_says_why_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(tile: object) -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused_module, "_COMPILED", fused_module._CompiledTiles())
    monkeypatch.setattr(fused_module, "_probe", broken)
    fused, eager = _pair()
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="relaygr.model.fused"):
        # the eager fallback tiles keys too, so blocks still need no bound on a CPU
        assert fused.attention_kernel.score_budget(1, cpu) > 1 << 40
        items, cands = torch.arange(1, 150), torch.arange(1, 20)
        assert_close(fused.rank(cands, prefix_items=items), eager.rank(cands, prefix_items=items))
        fused.rank(cands, prefix_items=items)
    assert fused.describe_attention() == "eager (fused unavailable: RuntimeError: no C++ compiler)"
    assert [r.getMessage() for r in caplog.records] == [
        "fused attention unavailable, running eager: RuntimeError: no C++ compiler"]


def test_blocks_are_bounded_only_where_keys_are_not_tiled() -> None:
    """On a CPU both kernels tile keys, so blocks need no bound; on a GPU the eager kernel takes
    whole segments and blocks keep the configured one."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kernel = FusedAttention(TINY_TILES)
    assert kernel.describe(cuda) == "eager (the fused kernel is CPU-only; cuda runs eager)"
    assert kernel.score_budget(4096, cuda) == 4096
    assert kernel.score_budget(4096, cpu) > 1 << 40
    assert EagerAttention(TINY_TILES).score_budget(4096, cpu) > 1 << 40
    assert EagerAttention(TINY_TILES).score_budget(4096, cuda) == 4096
    assert EagerAttention().score_budget(4096, cpu) == 4096


@pytest.mark.parametrize("timed", [False, True])
def test_eager_key_tiles_compute_what_whole_segments_do(timed: bool) -> None:
    """The eager kernel's tiles (64 keys here) change only the order of the key sum."""
    tiled = make_model(attention_tile_elems=TINY_TILES, num_heads=2)
    whole = make_model(num_heads=2)
    whole.load_state_dict(tiled.state_dict())
    whole.use_attention_kernel(EagerAttention())
    gen = torch.Generator().manual_seed(7)
    items, ts = random_history(gen, 410, 500, timed)
    cands = torch.randint(1, 501, (33,), generator=gen)
    query_ts = None if ts is None else int(ts[-1]) + 60
    kv_tiled, kv_whole = tiled.prefill(items, ts), whole.prefill(items, ts)
    assert_close(kv_tiled.k, kv_whole.k)
    assert_close(kv_tiled.v, kv_whole.v)
    assert_close(tiled.rank(cands, prefix=kv_tiled, query_timestamp=query_ts),
                 whole.rank(cands, prefix=kv_whole, query_timestamp=query_ts))


def test_a_resumable_prefill_bounds_its_chunks_and_a_whole_one_does_not() -> None:
    """``prefill_job`` (the scheduler's pre-infer unit) keeps each history chunk within
    ``score_block_elems`` scores; ``prefill`` runs full ``query_block`` chunks, with the same
    keys and values."""
    model = make_model(num_heads=2, query_block=64, score_block_elems=2 * 64 * 96)
    items = torch.arange(1, 301)
    job = model.prefill_job([PrefillInput(items)])
    chunks = []
    with torch.inference_mode():
        while not job.done:
            before = job.tracks[0].done_tokens
            job.step()
            chunks.append(job.tracks[0].done_tokens - before)
    assert chunks[0] == 64 and max(chunks[1:]) < 64 and sum(chunks) == 300
    whole = model.prefill(items)
    assert_close(job.tracks[0].prefix().k, whole.k)
    assert_close(job.tracks[0].prefix().v, whole.v)


def test_the_kernel_is_chosen_by_name_and_an_unknown_one_is_refused() -> None:
    assert HSTUConfig(num_items=5).attention == "eager"
    with pytest.raises(ConfigError, match="attention"):
        HSTUConfig(num_items=5, attention="flash")
    with pytest.raises(ConfigError, match="attention_tile_elems"):
        HSTUConfig(num_items=5, attention_tile_elems=0)
