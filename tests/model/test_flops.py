"""FLOP counts match a hand count on a tiny config."""

from __future__ import annotations

from relaygr.model import HSTUConfig
from relaygr.model.flops import (
    candidate_flops,
    prefill_flops,
    prefill_score_elements,
    rank_flops,
    rank_score_elements,
)


def test_hand_counted_flops() -> None:
    cfg = HSTUConfig(num_items=10, dim=4, num_layers=1, num_heads=2)
    # dense: 2 * (4*4*4 + 4*4) = 160 per token; 3 tokens see 1+2+3 = 6 keys: 2*2*4*6 = 96
    assert prefill_flops(cfg, 3) == 3 * 160 + 96
    # after 5 cached tokens, 2 new tokens see 6 and 7 keys
    assert prefill_flops(cfg, 2, past_tokens=5) == 2 * 160 + 2 * 2 * 4 * 13
    # 2 candidates over 10 history tokens see 11 keys each; head 2*(16+4) each
    assert candidate_flops(cfg, 2, 10) == 2 * 160 + 2 * 2 * 4 * 22 + 2 * 40
    assert rank_flops(cfg, 2, 8, 2, cached=False) == prefill_flops(cfg, 10) + candidate_flops(
        cfg, 2, 10)
    assert rank_flops(cfg, 2, 8, 2, cached=True) == prefill_flops(cfg, 2, 8) + candidate_flops(
        cfg, 2, 10)


def test_score_elements_count_each_causal_query_key_pair_per_head_and_layer() -> None:
    cfg = HSTUConfig(num_items=10, dim=8, num_layers=3, num_heads=2, max_seq_len=64)
    # 4 new tokens after 5 cached ones see 6, 7, 8, 9 keys
    assert prefill_score_elements(cfg, 4, 5) == 3 * 2 * (6 + 7 + 8 + 9)
    # 10 candidates on a 5 + 2 token history: the suffix (6 + 7 keys), then 8 keys each
    cached = rank_score_elements(cfg, 10, 5, 2, cached=True)
    assert cached == 3 * 2 * ((6 + 7) + 10 * 8)
    full = rank_score_elements(cfg, 10, 5, 2, cached=False)
    assert full == 3 * 2 * (sum(range(1, 8)) + 10 * 8)
