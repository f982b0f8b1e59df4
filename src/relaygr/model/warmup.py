"""Warm-up: each kind of serving pass run once before the first request.

The fused attention kernel compiles a graph the first time it sees a layout of its inputs (a key
tile that is a whole segment or a slice of one, more queries than keys or fewer). ``warm_up`` runs
prefill, the extension of a cached prefix, full and cached ranking, with and without timestamps,
on short random histories with the smallest key tiles, so that a few hundred tokens show every
layout a long history makes, and no request pays for a compilation. It leaves the model as it
found it (the model holds no cache state; the kernel is put back).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from relaygr.model.config import HSTUConfig
from relaygr.model.fused import AttentionKernel, attention_kernel
from relaygr.model.inputs import IntSeq
from relaygr.model.kv import PrefixKV


class WarmUpModel(Protocol):
    """What the warm-up reads of the model (``HSTU`` is one)."""

    @property
    def cfg(self) -> HSTUConfig: ...

    def prefill(self, items: IntSeq, timestamps: IntSeq | None = None,
                past: PrefixKV | None = None, next_timestamp: int | None = None) -> PrefixKV: ...

    def rank(self, candidates: IntSeq, prefix: PrefixKV | None = None,
             prefix_items: IntSeq | None = None, prefix_timestamps: IntSeq | None = None,
             suffix_items: IntSeq | None = None, suffix_timestamps: IntSeq | None = None,
             query_timestamp: int | None = None) -> Tensor: ...

    def use_attention_kernel(self, kernel: AttentionKernel) -> AttentionKernel: ...


# Timestamps of the warm-up histories: a fixed start and gap (their values do not matter).
_START_TS, _GAP_S = 1_600_000_000, 997


@torch.inference_mode()
def warm_up(model: WarmUpModel) -> None:
    """Run every kind of serving pass of ``model`` once (module docstring)."""
    cfg, gen = model.cfg, torch.Generator().manual_seed(0)
    kernel = model.use_attention_kernel(attention_kernel(cfg.attention, tile_elems=1))
    try:
        count = min(cfg.candidate_block, cfg.num_items)
        candidates = torch.randint(1, cfg.num_items + 1, (count,), generator=gen)
        # one history of several query blocks; one shorter than a tile (whole-segment tiles)
        for length in (min(cfg.max_seq_len - 1, 2 * cfg.query_block + 17),
                       min(cfg.max_seq_len - 1, 40)):
            items = torch.randint(1, cfg.num_items + 1, (length,), generator=gen)
            for timed in (False, True):
                ts = _START_TS + torch.arange(length) * _GAP_S if timed else None
                _passes(model, items, ts, candidates)
    finally:
        model.use_attention_kernel(kernel)


def _passes(model: WarmUpModel, items: Tensor, ts: Tensor | None, candidates: Tensor) -> None:
    cut = max(1, len(items) - max(1, len(items) // 3))     # both parts non-empty when >= 2
    query_ts = None if ts is None else int(ts[-1]) + 1
    # a time_query="next" prefix is computed for the time after it: the next event's, the request's
    after: list[int | None] = [None, None]
    if ts is not None and model.cfg.next_time_query:
        after = [int(ts[cut]) if cut < len(items) else query_ts, query_ts]
    kv = model.prefill(items[:cut], None if ts is None else ts[:cut], next_timestamp=after[0])
    if cut < len(items):
        kv = model.prefill(items[cut:], None if ts is None else ts[cut:], past=kv,
                           next_timestamp=after[1])
    model.rank(candidates, prefix=kv, query_timestamp=query_ts)
    model.rank(candidates, prefix_items=items, prefix_timestamps=ts, query_timestamp=query_ts)
