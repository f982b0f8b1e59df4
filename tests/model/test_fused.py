"""The fused attention kernel computes the eager reference's function, and falls back visibly.

These tests compile the kernel once per test session (seconds with inductor's on-disk cache);
the shapes are small and the tile size is tiny, so that every block spans several key tiles.
"""

from __future__ import annotations

import logging

import pytest
import torch

from relaygr.errors import ConfigError
from relaygr.model import HSTUConfig
from relaygr.model import fused as fused_module
from relaygr.model.fused import EagerAttention, FusedAttention
from tests.model.helpers import assert_close, make_model, random_history

# 2 heads x 64-key tiles: every block of more than 64 keys is split into tiles
TINY_TILES = 2 * 64


def _pair(**overrides: object) -> tuple[torch.nn.Module, torch.nn.Module]:
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
    rest = {"suffix_items": items[length:] if suffix else None,
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
        assert fused.attention_kernel.score_budget(1, cpu, timed_history=False) == 1
        items, cands = torch.arange(1, 150), torch.arange(1, 20)
        assert_close(fused.rank(cands, prefix_items=items), eager.rank(cands, prefix_items=items))
        fused.rank(cands, prefix_items=items)
    assert fused.describe_attention() == "eager (fused unavailable: RuntimeError: no C++ compiler)"
    assert [r.getMessage() for r in caplog.records] == [
        "fused attention unavailable, running eager: RuntimeError: no C++ compiler"]


def test_the_fused_kernel_is_cpu_only_and_bounds_blocks_only_where_it_runs_eager() -> None:
    kernel, cuda = FusedAttention(TINY_TILES), torch.device("cuda")
    assert kernel.describe(cuda) == "eager (the fused kernel is CPU-only; cuda runs eager)"
    assert kernel.score_budget(4096, cuda, timed_history=False) == 4096
    cpu = torch.device("cpu")
    assert kernel.score_budget(4096, cpu, timed_history=True) == 4096
    assert kernel.score_budget(4096, cpu, timed_history=False) > 1 << 40
    assert EagerAttention().score_budget(4096, cpu, timed_history=False) == 4096


def test_the_kernel_is_chosen_by_name_and_an_unknown_one_is_refused() -> None:
    assert HSTUConfig(num_items=5).attention == "eager"
    with pytest.raises(ConfigError, match="attention"):
        HSTUConfig(num_items=5, attention="flash")
    with pytest.raises(ConfigError, match="attention_tile_elems"):
        HSTUConfig(num_items=5, attention_tile_elems=0)
