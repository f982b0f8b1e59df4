"""The relay's correctness contract: ranking from a cached prefix equals the full pass, in
either layer style (``HSTUConfig.layer_style``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.model import RankInput, concat_prefix
from relaygr.model.config import LAYER_STYLES
from tests.model.helpers import assert_close, make_model, random_history

configs = st.fixed_dictionaries({
    "dim": st.sampled_from([16, 32]),
    "num_layers": st.integers(1, 3),
    "num_heads": st.sampled_from([1, 2, 4]),
    "query_block": st.sampled_from([32, 64, 256]),
    "candidate_block": st.sampled_from([7, 64, 512]),
    # key tiles of 16 keys a score row or more: tiny tiles split every segment, the default
    # almost never does
    "attention_tile_elems": st.sampled_from([64, 4096, 1 << 19]),
    "final_norm": st.booleans(),
    "rank_score": st.sampled_from(["state", "retrieval_residual"]),
    "retrieval_similarity": st.sampled_from(["dot", "cosine"]),
})


@pytest.mark.parametrize("layer_style", LAYER_STYLES)
@settings(max_examples=30, deadline=None)
@given(cfg=configs, prefix_len=st.integers(1, 2048), suffix_len=st.integers(0, 40),
       num_candidates=st.integers(1, 80), timed=st.booleans(), seed=st.integers(0, 2**16))
def test_cached_rank_equals_full_pass(layer_style: str, cfg: dict, prefix_len: int,
                                      suffix_len: int, num_candidates: int, timed: bool,
                                      seed: int) -> None:
    model = make_model(seed, layer_style=layer_style, **cfg)
    gen = torch.Generator().manual_seed(seed)
    items, ts = random_history(gen, prefix_len + suffix_len, 500, timed)
    cands = torch.randint(1, 501, (num_candidates,), generator=gen)
    query_ts = int(ts[-1]) + 3600 if ts is not None else None
    suffix = items[prefix_len:] if suffix_len else None
    suffix_ts = ts[prefix_len:] if (ts is not None and suffix_len) else None
    prefix_ts = ts[:prefix_len] if ts is not None else None

    kv = model.prefill(items[:prefix_len], prefix_ts)
    cached = model.rank(cands, prefix=kv, suffix_items=suffix, suffix_timestamps=suffix_ts,
                        query_timestamp=query_ts)
    full = model.rank(cands, prefix_items=items[:prefix_len], prefix_timestamps=prefix_ts,
                      suffix_items=suffix, suffix_timestamps=suffix_ts, query_timestamp=query_ts)
    assert cached.shape == (num_candidates,)
    assert_close(cached, full)


@pytest.mark.parametrize("layer_style", LAYER_STYLES)
@settings(max_examples=15, deadline=None)
@given(length=st.integers(1, 300), num_candidates=st.integers(1, 30), timed=st.booleans(),
       final_norm=st.booleans(), rank_score=st.sampled_from(["state", "retrieval_residual"]),
       tile_elems=st.sampled_from([64, 1 << 19]), seed=st.integers(0, 2**16))
def test_serving_path_equals_dense_reference(layer_style: str, length: int, num_candidates: int,
                                             timed: bool, final_norm: bool, rank_score: str,
                                             tile_elems: int, seed: int) -> None:
    """The chunked serving pass computes the paper's masked dense attention, and the ranking
    head (with or without the retrieval logit) reads the same states in both paths."""
    model = make_model(seed, query_block=32, final_norm=final_norm, rank_score=rank_score,
                       retrieval_similarity="cosine", retrieval_temperature=0.05,
                       attention_tile_elems=tile_elems, layer_style=layer_style)
    gen = torch.Generator().manual_seed(seed)
    items, ts = random_history(gen, length, 500, timed)
    cands = torch.randint(1, 501, (num_candidates,), generator=gen)
    query_ts = int(ts[-1]) + 60 if ts is not None else None
    served = model.rank(cands, prefix_items=items, prefix_timestamps=ts, query_timestamp=query_ts)
    with torch.no_grad():
        dense = model.rank_padded(items[None], cands[None], None if ts is None else ts[None],
                                  None if ts is None else torch.tensor([query_ts]))[0]
        hidden = model.encode_padded(items[None], None if ts is None else ts[None])[0]
    assert_close(served, dense)
    assert_close(model.prefill(items, ts).last_hidden, hidden[-1])


@pytest.mark.parametrize("layer_style", LAYER_STYLES)
@settings(max_examples=25, deadline=None)
@given(first=st.integers(1, 700), second=st.integers(1, 400), timed=st.booleans(),
       seed=st.integers(0, 2**16))
def test_prefill_extension_equals_prefill_of_concatenation(layer_style: str, first: int,
                                                           second: int, timed: bool,
                                                           seed: int) -> None:
    model = make_model(seed, layer_style=layer_style)
    gen = torch.Generator().manual_seed(seed)
    items, ts = random_history(gen, first + second, 500, timed)
    head_ts = None if ts is None else ts[:first]
    tail_ts = None if ts is None else ts[first:]
    extended = model.prefill(items[first:], tail_ts, past=model.prefill(items[:first], head_ts))
    whole = model.prefill(items, ts)
    assert extended.num_tokens == whole.num_tokens == first + second
    assert_close(extended.k, whole.k)
    assert_close(extended.v, whole.v)
    assert_close(extended.last_hidden, whole.last_hidden)
    if ts is not None:
        assert extended.timestamps is not None
        assert whole.timestamps is not None
        assert torch.equal(extended.timestamps, whole.timestamps)


def test_time_bias_changes_scores_but_not_exactness() -> None:
    """The request time moves candidate scores (it is used) without invalidating the cache."""
    model = make_model(3)
    gen = torch.Generator().manual_seed(3)
    items, ts = random_history(gen, 200, 500, timed=True)
    assert ts is not None
    cands = torch.arange(1, 21)
    kv = model.prefill(items, ts)
    soon = model.rank(cands, prefix=kv, query_timestamp=int(ts[-1]) + 10)
    later = model.rank(cands, prefix=kv, query_timestamp=int(ts[-1]) + 10_000_000)
    assert (soon - later).abs().max() > 1e-3
    assert_close(later, model.rank(cands, prefix_items=items, prefix_timestamps=ts,
                                   query_timestamp=int(ts[-1]) + 10_000_000))


@pytest.mark.parametrize("layer_style", LAYER_STYLES)
@settings(max_examples=10, deadline=None)
@given(prefix_len=st.integers(1, 500), suffix_len=st.integers(1, 50), timed=st.booleans(),
       seed=st.integers(0, 2**16))
def test_ranking_returns_the_suffix_kv_of_the_next_prefix(layer_style: str, prefix_len: int,
                                                          suffix_len: int, timed: bool,
                                                          seed: int) -> None:
    """prefix K/V + the suffix K/V a ranking pass computed == prefill of prefix + suffix."""
    model = make_model(seed, layer_style=layer_style)
    gen = torch.Generator().manual_seed(seed)
    items, ts = random_history(gen, prefix_len + suffix_len, 500, timed)
    kv = model.prefill(items[:prefix_len], None if ts is None else ts[:prefix_len])
    out = model.rank_batch_outputs([RankInput(
        torch.arange(1, 11), prefix=kv, suffix_items=items[prefix_len:],
        suffix_timestamps=None if ts is None else ts[prefix_len:])])[0]
    assert out.computed is not None and out.computed.num_tokens == suffix_len
    grown = concat_prefix(kv, out.computed)
    whole = model.prefill(items, ts)
    assert_close(grown.k, whole.k)
    assert_close(grown.v, whole.v)
    assert_close(grown.last_hidden, whole.last_hidden)
    assert (grown.timestamps is None) == (ts is None)
    cached_only = model.rank_batch_outputs([RankInput(torch.arange(1, 5), prefix=kv)])[0]
    assert cached_only.computed is None
