"""FLOP counts match a hand count on a tiny config."""

from __future__ import annotations

from relaygr.model import HSTUConfig
from relaygr.model.flops import candidate_flops, prefill_flops, rank_flops


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
