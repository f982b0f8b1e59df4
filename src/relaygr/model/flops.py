"""Work of the serving passes: what "achieved fraction of peak" and the physical limit use.

``*_flops`` count 2 FLOPs per multiply-add of the projections, the attention products (QKᵀ and
AV over the keys a token may see, i.e. causal work only, never the masked half of a block) and
the ranking head. ``*_score_elements`` count the attention scores a pass makes (one per query,
key and head, causal only): each gets the element-wise work the matmuls do not do (relative bias,
SiLU, mask, normaliser), which costs real time on a CPU whose matrix units are fast.
"""

from __future__ import annotations

from relaygr.model.config import HSTUConfig


def _dense_per_token(cfg: HSTUConfig) -> int:
    # f1: d → 4d and f2: d → d, per layer
    return cfg.num_layers * 2 * (4 * cfg.dim * cfg.dim + cfg.dim * cfg.dim)


def _attention(cfg: HSTUConfig, keys_seen: int) -> int:
    # QKᵀ and AV over `keys_seen` (query, key) pairs, all heads (heads x head_dim = dim)
    return cfg.num_layers * 2 * 2 * cfg.dim * keys_seen


def prefill_flops(cfg: HSTUConfig, new_tokens: int, past_tokens: int = 0) -> int:
    """FLOPs of computing ``new_tokens`` history tokens after ``past_tokens`` cached ones."""
    # token i (1-based among the new ones) sees past_tokens + i keys
    keys_seen = new_tokens * past_tokens + new_tokens * (new_tokens + 1) // 2
    return new_tokens * _dense_per_token(cfg) + _attention(cfg, keys_seen)


def candidate_flops(cfg: HSTUConfig, candidates: int, history_tokens: int) -> int:
    """FLOPs of scoring ``candidates`` against a history of ``history_tokens`` (plus self)."""
    head = candidates * 2 * (cfg.dim * cfg.dim + cfg.dim)
    return (candidates * _dense_per_token(cfg)
            + _attention(cfg, candidates * (history_tokens + 1)) + head)


def rank_flops(cfg: HSTUConfig, candidates: int, prefix_tokens: int, suffix_tokens: int = 0,
               cached: bool = True) -> int:
    """FLOPs of one ranking request, from a cached prefix or as a full pass."""
    history = prefix_tokens + suffix_tokens
    if cached:
        work = prefill_flops(cfg, suffix_tokens, prefix_tokens) if suffix_tokens else 0
    else:
        work = prefill_flops(cfg, history)
    return work + candidate_flops(cfg, candidates, history)


def _scores(cfg: HSTUConfig, keys_seen: int) -> int:
    return cfg.num_layers * cfg.num_heads * keys_seen


def prefill_score_elements(cfg: HSTUConfig, new_tokens: int, past_tokens: int = 0) -> int:
    """Attention scores of computing ``new_tokens`` after ``past_tokens`` cached ones."""
    return _scores(cfg, new_tokens * past_tokens + new_tokens * (new_tokens + 1) // 2)


def rank_score_elements(cfg: HSTUConfig, candidates: int, prefix_tokens: int,
                        suffix_tokens: int = 0, cached: bool = True) -> int:
    """Attention scores of one ranking request, from a cached prefix or as a full pass."""
    history = prefix_tokens + suffix_tokens
    if cached:
        work = prefill_score_elements(cfg, suffix_tokens, prefix_tokens) if suffix_tokens else 0
    else:
        work = prefill_score_elements(cfg, history)
    return work + _scores(cfg, candidates * (history + 1))
