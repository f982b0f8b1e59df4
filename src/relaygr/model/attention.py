"""SiLU attention of HSTU: ``SiLU(Q Kᵀ + rab) · V / n``, two implementations of one function.

* ``dense_attention``: padded batches with explicit masks, as the paper writes it. Used for
  training (short sequences) and as the reference the fast path is tested against.
* ``block_attention`` / ``candidate_attention``: the serving path. Because there is no softmax,
  attention is a plain sum over keys, so keys may be split into segments (a cached prefix, the
  tokens computed in this pass) and their contributions added: that is what makes a cached
  prefix exact rather than approximate. Queries are processed in blocks so the score matrix stays
  ``heads x block x keys`` however long the prefix is.

The relative position bias is a Toeplitz matrix ``T[i, j] = w[i - j]``. Rather than gathering it,
``block_attention`` takes it as a strided view of the reversed bias vector: with the query rows in
reverse order, ``T`` has stride +1 along both axes, so it costs no memory and no gather pass. The
causal mask rides in the same view: future keys read ``MASKED`` (-1e30) and ``SiLU(-1e30 + x)`` is
exactly ``-0.0`` in float32 and bfloat16, so masking costs no pass either (float16, whose range
stops at 65504, is not supported).

On a CPU the serving path also splits keys into tiles (``key_tiles``) of a fixed number of
scores, so a tile's scores are still in cache when SiLU reads them and ``S V`` multiplies them,
and a block or micro-batch need not shrink at long prefixes to keep them there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from relaygr.model.layers import table_lookup

# Time buckets: floor(log_{1.5}(1 + |dt| seconds)), so gaps from a second to decades each get
# a bucket of roughly constant relative width. Computed exactly, in integers: bucket b starts at
# the gap ceil(1.5^b - 1), so one binary search per pair replaces a chain of float passes and
# every device agrees on every boundary.
_TIME_BUCKET_LOG_BASE = 1.5


@functools.lru_cache(maxsize=16)
def _bucket_starts(num_buckets: int, device: torch.device) -> Tensor:
    starts = [math.ceil(_TIME_BUCKET_LOG_BASE ** b - 1) for b in range(1, num_buckets)]
    return torch.tensor(starts, dtype=torch.int64, device=device)


def time_buckets(query_ts: Tensor, key_ts: Tensor, num_buckets: int) -> Tensor:
    """Bucket index of every (query, key) gap: ``[*query_ts.shape, *key_ts.shape]`` int32.

    ``query_ts`` and ``key_ts`` are int64 seconds; the broadcast is ``query[..., None] - key``.
    A token attending to itself (gap 0) always lands in bucket 0.
    """
    gap = (query_ts.unsqueeze(-1) - key_ts).abs_()
    return torch.bucketize(gap, _bucket_starts(num_buckets, gap.device), out_int32=True,
                           right=True)


def time_buckets_sorted(query_ts: Tensor, key_ts: Tensor, num_buckets: int) -> Tensor:
    """``time_buckets`` for ``[n]`` queries over ``[e]`` keys in time order, ~4x faster.

    Exact wherever a key is not later than the query (``key_ts[j] <= query_ts[i]``: every pair
    a causal history with non-decreasing timestamps attends to); other entries are 0, which is
    fine for keys a query cannot see. Row i's bucket falls by one at each key where the gap
    crosses a bucket start, so the row is a cumulative sum that starts at the top bucket and
    steps down at those crossings, found by binary search over the sorted keys
    (``searchsorted``) instead of one search per pair.
    """
    starts = _bucket_starts(num_buckets, key_ts.device)
    n, e = query_ts.shape[0], key_ts.shape[0]
    # crossing[i, b]: keys with key_ts <= query_ts[i] - starts[b] have a gap >= starts[b], so
    # key j's bucket is the number of b with crossing[i, b] > j
    crossing = torch.searchsorted(key_ts, query_ts[:, None] - starts, right=True)
    steps = torch.zeros(n, e + 1, dtype=torch.int32, device=key_ts.device)
    steps[:, 0] = starts.numel()
    steps.scatter_add_(1, crossing, torch.full_like(crossing, -1, dtype=torch.int32))
    return steps[:, :e].cumsum(1, dtype=torch.int32)


def is_time_ordered(ts: Tensor) -> bool:
    """Whether ``ts`` is non-decreasing (the fast time-bucket path's condition)."""
    return ts.numel() < 2 or bool((ts[1:] >= ts[:-1]).all())


# A bias that SiLU turns into exactly zero: how a future key is masked without a mask pass.
MASKED = -1e30


# Elements before the start of a ``reversed_padded`` vector, so that no view into it starts at
# storage offset 0 or 1 (a compiled kernel would otherwise specialise its graph on those two).
_VIEW_LEAD = 2


def reversed_padded(pos_w: Tensor, pad: int) -> Tensor:
    """``cat(pos_w.flip(0), MASKED * ones(pad))``: the vector ``toeplitz_reversed`` strides over
    (it starts ``_VIEW_LEAD`` elements into its storage)."""
    n = pos_w.numel()
    out = pos_w.new_empty(_VIEW_LEAD + n + pad)[_VIEW_LEAD:]
    out[:n] = pos_w.flip(0)
    out[n:] = MASKED
    return out


def toeplitz_reversed(pos_w_padded_rev: Tensor, query_start: int, num_queries: int,
                      num_keys: int, max_distance: int) -> Tensor:
    """View ``B[i', j] = pos_w[(query_start + num_queries - 1 - i') - j]`` (rows reversed).

    ``pos_w_padded_rev`` is ``reversed_padded(pos_w, pad >= num_queries)`` where ``pos_w`` has
    ``max_distance + 1`` entries; entries with a negative distance (future keys) read the
    ``MASKED`` padding. Shape ``[num_queries, num_keys]``, no copy.
    """
    offset = max_distance - (query_start + num_queries) + 1
    assert offset >= 0, "query positions exceed max_distance"
    return pos_w_padded_rev.as_strided((num_queries, num_keys), (1, 1),
                                       pos_w_padded_rev.storage_offset() + offset)


def tile_width(tile_elems: int, rows: int) -> int:
    """Keys per tile for ``rows`` (heads x queries) score rows, so a tile holds about
    ``tile_elems`` scores: a multiple of 16 (one AVX-512 vector of float32), at least 64 so the
    matmuls stay efficient."""
    width = tile_elems // max(rows, 1)
    return max(64, width - width % 16)


def key_tiles(segments: list[tuple[Tensor, Tensor]],
              width: int | None) -> Iterator[tuple[int, Tensor, Tensor]]:
    """``(first key position, K, V)`` of consecutive key tiles covering ``segments`` in order,
    at most ``width`` keys each (``None``: one tile per segment). Tiles are views."""
    col = 0
    for k, v in segments:
        m = k.shape[1]
        step = m if width is None else width
        for start in range(0, m, max(step, 1)):
            n = min(step, m - start)
            yield col + start, k.narrow(1, start, n), v.narrow(1, start, n)
        col += m


def block_attention(q_rev: Tensor, segments: list[tuple[Tensor, Tensor]], bias_rev: Tensor,
                    normalizer: float, tile_keys: int | None = None,
                    time_bias: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Causal SiLU attention of one query block over keys split into consecutive segments.

    ``q_rev``: ``[H, n, dh]`` queries in *reverse* order (the block's last token first); they sit
    at the last ``n`` key positions. ``segments``: ``(K, V)`` pairs ``[H, m, dh]`` covering key
    positions ``0 .. e-1`` in order; the last segment holds the block's own keys at its end.
    ``bias_rev``: ``[n, e]`` (rows reversed like the queries), ``MASKED`` on future keys.
    ``tile_keys``: keys per tile (``key_tiles``), so that a tile's scores stay in cache between
    the two matmuls however long the prefix is; ``None``: whole segments. ``time_bias``:
    ``(table, buckets)``, rab^t as ``table[buckets]`` (``[n, e]`` int32 buckets, rows reversed),
    added to the bias a tile at a time. Returns ``[H, n, dh]`` in the original (forward) query
    order.
    """
    out: Tensor | None = None
    end = 0
    for col, k, v in key_tiles(segments, tile_keys):
        end = col + k.shape[1]
        bias = bias_rev[:, col:end]
        if time_bias is not None:
            table, buckets = time_bias
            bias = table_lookup(table, buckets[:, col:end]).add_(bias)
        scores = torch.baddbmm(bias.unsqueeze(0), q_rev, k.transpose(1, 2))
        F.silu(scores, inplace=True)
        out = torch.bmm(scores, v) if out is None else out.baddbmm_(scores, v)
    assert out is not None and end == bias_rev.shape[1], "segments must cover the bias columns"
    return out.flip(1).div_(normalizer)


def candidate_attention(q: Tensor, k_self: Tensor, v_self: Tensor,
                        segments: list[tuple[Tensor, Tensor]], bias: Tensor, self_bias: Tensor,
                        normalizer: float, tile_keys: int | None = None) -> Tensor:
    """Candidates attend to every history key and to themselves, never to each other.

    ``q``, ``k_self``, ``v_self``: ``[H, C, dh]``; ``segments``: history ``(K, V)`` pairs
    ``[H, m, dh]`` covering positions ``0 .. e-1``; ``bias``: ``[e]`` (every candidate sits at
    the same position, so one row serves all); ``self_bias``: scalar tensor; ``tile_keys`` as
    in ``block_attention``. Returns ``[H, C, dh]``. Each candidate's row depends only on itself
    and the history, which is why scores do not depend on candidate order or micro-batching.
    """
    self_scores = (q * k_self).sum(-1, keepdim=True).add_(self_bias)
    out = F.silu(self_scores) * v_self
    for col, k, v in key_tiles(segments, tile_keys):
        m = k.shape[1]
        scores = torch.baddbmm(bias[col:col + m].view(1, 1, m), q, k.transpose(1, 2))
        F.silu(scores, inplace=True)
        out.baddbmm_(scores, v)
    return out.div_(normalizer)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, visible: Tensor,
                    normalizer: float) -> Tensor:
    """Reference SiLU attention with explicit masks (padded batches, training).

    ``q``: ``[B, H, Tq, dh]``; ``k``, ``v``: ``[B, H, Tk, dh]``; ``bias``: broadcastable to
    ``[B, H, Tq, Tk]``; ``visible``: bool broadcastable to the same, False where a query must
    not see a key (future, padding, another candidate). Returns ``[B, H, Tq, dh]``.
    """
    scores = F.silu(q @ k.transpose(-1, -2) + bias) * visible
    return (scores @ v) / normalizer


def last_timestamps(timestamps: Tensor, lengths: Tensor) -> Tensor:
    """``[B, T]`` right-padded timestamps, ``[B]`` lengths → ``[B]`` each row's last one."""
    return timestamps.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)


def following_timestamps(timestamps: Tensor, lengths: Tensor,
                         query_timestamps: Tensor | None = None) -> Tensor:
    """``[B, T]`` right-padded timestamps → the time of the event after each position (what a
    model with ``time_query="next"`` measures from): the next event's, and at each row's last
    position ``query_timestamps`` ``[B]`` (the request's; default: that position's own)."""
    if query_timestamps is None:
        query_timestamps = last_timestamps(timestamps, lengths)
    out = torch.cat([timestamps[:, 1:], timestamps[:, :1]], dim=1)
    rows = torch.arange(len(timestamps), device=timestamps.device)
    out[rows, (lengths - 1).clamp(min=0)] = query_timestamps
    return out
