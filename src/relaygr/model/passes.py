"""The serving forward pass: several users at once, history in chunks, candidates isolated.

A ``Pass`` advances in *rounds*. In one round every user with work left contributes its next
history chunk (at most ``query_block`` tokens) and, once its history is complete, a micro-batch of
at most ``candidate_block`` candidates. On a CPU the attention kernels split keys into tiles that
stay in cache (``attention.key_tiles``); where a kernel makes a block's scores whole instead (the
eager kernel on a GPU), both shrink at long histories so that no score matrix of a round exceeds
``score_block_elems`` elements. All tokens of a round go through each layer's dense parts (norms,
projections) as one jagged batch; attention runs per user over that user's key segments: its
cached past (read-only) and the buffer this pass fills. A round is also the unit of work the
instance scheduler interleaves with ranking, which is how pre-inference is chunked: a pass built
with ``round_scores`` (``HSTU.prefill_job``) keeps each history chunk within that many scores,
so a chunk's work stays bounded at long prefixes; a pass run whole (a ranking batch, a prefill
that nothing waits behind) takes full ``query_block`` chunks.

Invariants: a history token at position p is embedded and attended identically whichever round,
batch or pass computes it, so a prefix computed here and reused later gives the same keys and
values as computing it inside the ranking pass. Under ``time_query="next"`` a token also reads the
time of the event after it, so a prefix is reused only where its continuation starts at the time
it was computed for (``PrefixKV.next_timestamp``, checked in ``model.inputs``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from relaygr.errors import IncompatiblePrefixError
from relaygr.model.attention import (
    is_time_ordered,
    reversed_padded,
    time_buckets,
    time_buckets_sorted,
    toeplitz_reversed,
)
from relaygr.model.config import HSTUConfig
from relaygr.model.fused import AttentionKernel, TimeBias
from relaygr.model.inputs import History
from relaygr.model.kv import PrefixKV
from relaygr.model.layers import HSTULayer


class PassModel(Protocol):
    """What a pass reads of the model (``HSTU`` is one): its shape, token embeddings, layers
    and heads. The model holds no pass state; a pass holds no weights."""

    @property
    def cfg(self) -> HSTUConfig: ...

    @property
    def blocks(self) -> list[HSTULayer]: ...

    @property
    def attention_kernel(self) -> AttentionKernel: ...

    @property
    def input_dropout(self) -> nn.Module: ...

    @property
    def final_norm(self) -> nn.Module: ...

    def rank_prior(self, user: Tensor, candidates: Tensor) -> Tensor | None: ...

    def rank_logits(self, states: Tensor, prior: Tensor | None) -> Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def embed_history(self, items: Tensor, positions: Tensor) -> Tensor: ...

    def embed_candidates(self, items: Tensor, position: int) -> Tensor: ...


# Smallest query block: below it per-block overhead outweighs cache locality.
_MIN_BLOCK = 32


@dataclass
class Track:
    """One user's work in a pass: history to compute after a cached past, candidates to score."""

    history: History
    candidates: Tensor | None = None   # [C] int64, None for a prefill
    query_ts: int | None = None
    k: Tensor = field(init=False)       # [L, H, T_new, dh]: keys of the tokens computed here
    v: Tensor = field(init=False)
    key_ts: Tensor | None = field(init=False)  # [past + T_new] timestamps of all history keys
    # [past + T_new] the time each history token queries at: its own, or under
    # time_query="next" the next token's (the last one's: History.next_ts)
    query_times: Tensor | None = field(init=False)
    time_ordered: bool = field(init=False)      # key_ts non-decreasing: fast time buckets
    done_tokens: int = 0                # new history tokens already computed
    done_candidates: int = 0
    last_hidden: Tensor | None = None   # final output of the last history token computed
    # under time_query="next": the final output of the history's second-last token, the last
    # one a later continuation can reuse (``kept``); None until computed, or when it is the past's
    kept_hidden: Tensor | None = None
    scores: list[Tensor] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return int(self.history.items.numel())

    @property
    def finished(self) -> bool:
        if self.done_tokens < self.new_tokens:
            return False
        return self.candidates is None or self.done_candidates >= int(self.candidates.numel())

    def segments(self, layer: int, new_upto: int) -> list[tuple[Tensor, Tensor]]:
        """``(K, V)`` key segments of ``layer`` covering the past and ``new_upto`` new tokens."""
        segs = []
        past = self.history.past
        if past is not None and past.num_tokens:
            segs.append((past.k[layer], past.v[layer]))
        if new_upto:
            segs.append((self.k[layer, :, :new_upto], self.v[layer, :, :new_upto]))
        return segs

    def prefix(self) -> PrefixKV:
        """The K/V of the whole history (past + computed), as a new ``PrefixKV``."""
        tail = self.tail()
        past = self.history.past
        return tail if past is None or not past.num_tokens else concat_prefix(past, tail)

    def tail(self) -> PrefixKV:
        """The K/V of the tokens computed in this pass only (positions after the past)."""
        assert self.done_tokens == self.new_tokens and self.last_hidden is not None
        return PrefixKV(self.k, self.v, self.history.timestamps, self.last_hidden,
                        self.history.next_ts)

    def kept(self) -> PrefixKV | None:
        """What of ``tail`` a later pass can reuse, None when nothing: all of it, except under
        ``time_query="next"``, where the last token's K/V was computed for this pass's query
        time; a later continuation starts at that token's own time, so the reusable part ends
        one token earlier and is recorded as continuing there (``PrefixKV.next_timestamp``)."""
        if self.history.next_ts is None:
            return self.tail() if self.new_tokens else None
        if self.new_tokens < 2:
            return None                     # the past, if any, is all that is reusable
        assert self.done_tokens == self.new_tokens and self.kept_hidden is not None
        ts = self.history.timestamps
        assert ts is not None
        end = self.new_tokens - 1
        return PrefixKV(self.k[:, :, :end], self.v[:, :, :end], ts[:end], self.kept_hidden,
                        int(ts[end]))


def concat_prefix(past: PrefixKV, tail: PrefixKV, out_device: torch.device | None = None,
                  pin_memory: bool = False) -> PrefixKV:
    """``past`` followed by ``tail`` (the next positions) as one ``PrefixKV``, in one copy each.

    ``out_device`` (default: the past's) and ``pin_memory`` let a caller demote a prefix to host
    memory without an intermediate device copy.
    """
    if past.has_timestamps != tail.has_timestamps or past.dtype != tail.dtype \
            or past.k.shape[:2] != tail.k.shape[:2] or past.k.shape[3] != tail.k.shape[3]:
        raise IncompatiblePrefixError(
            f"cannot join {'a timed' if past.has_timestamps else 'an untimed'} {past.dtype} prefix "
            f"of shape {tuple(past.k.shape)} and a "
            f"{'timed' if tail.has_timestamps else 'untimed'} {tail.dtype} tail of shape "
            f"{tuple(tail.k.shape)}")
    if past.next_timestamp is not None and (tail.timestamps is None or tail.next_timestamp is None
                                            or int(tail.timestamps[0]) != past.next_timestamp):
        raise IncompatiblePrefixError(
            f"cannot join a prefix computed for a continuation at {past.next_timestamp} and a "
            f"tail that does not start then (time_query='next')")
    if past.next_timestamp is None and tail.next_timestamp is not None and past.num_tokens:
        raise IncompatiblePrefixError("cannot join a prefix without a continuation time and a "
                                      "time_query='next' tail")
    device = out_device or past.device
    n_past, n_tail = past.num_tokens, tail.num_tokens
    shape = (*past.k.shape[:2], n_past + n_tail, past.k.shape[3])
    k = torch.empty(shape, dtype=past.dtype, device=device, pin_memory=pin_memory)
    v = torch.empty(shape, dtype=past.dtype, device=device, pin_memory=pin_memory)
    k[:, :, :n_past], k[:, :, n_past:] = past.k, tail.k
    v[:, :, :n_past], v[:, :, n_past:] = past.v, tail.v
    ts = None
    if past.timestamps is not None and tail.timestamps is not None:
        ts = torch.cat([past.timestamps.to(device), tail.timestamps.to(device)])
    return PrefixKV(k, v, ts, tail.last_hidden.to(device), tail.next_timestamp)


@dataclass
class _Piece:
    """What one track contributes to one round: rows of the round's token matrix."""

    track: Track
    hist_start: int   # first new-history index of this chunk
    hist_len: int
    cand_start: int
    cand_len: int
    hist_buckets: Tensor | None = None  # [hist_len, keys] time buckets, rows reversed
    cand_buckets: Tensor | None = None  # [keys]


class Pass:
    """Drives a set of tracks through the model round by round (see the module docstring)."""

    def __init__(self, model: PassModel, tracks: list[Track],
                 round_scores: int | None = None) -> None:
        cfg = model.cfg
        self.model = model
        self.tracks = tracks
        self._pos_w_rev: dict[int, Tensor] = {}   # per layer, built once per pass
        param = next(model.parameters())
        self.kernel = model.attention_kernel
        # most scores of a candidate micro-batch, and of a history chunk (round_scores: the
        # bound of a resumable pass's rounds, None for a pass run whole)
        self._candidate_budget = self.kernel.score_budget(cfg.score_block_elems, param.device)
        self._block_budget = (self._candidate_budget if round_scores is None
                              else min(self._candidate_budget, round_scores))
        for t in tracks:
            shape = (cfg.num_layers, cfg.num_heads, t.new_tokens, cfg.head_dim)
            t.k = torch.empty(shape, device=param.device, dtype=param.dtype)
            t.v = torch.empty(shape, device=param.device, dtype=param.dtype)
            past = t.history.past
            if t.history.timestamps is None:
                t.key_ts = None
            elif past is not None and past.timestamps is not None and past.num_tokens:
                t.key_ts = torch.cat([past.timestamps, t.history.timestamps])
            else:
                t.key_ts = t.history.timestamps
            t.query_times = t.key_ts
            nxt = t.history.next_ts
            if t.key_ts is not None and nxt is not None:
                after = torch.tensor([nxt], dtype=t.key_ts.dtype, device=t.key_ts.device)
                t.query_times = torch.cat([t.key_ts[1:], after])
            t.time_ordered = t.key_ts is not None and is_time_ordered(t.key_ts) and (
                nxt is None or not t.key_ts.numel() or nxt >= int(t.key_ts[-1]))
            if past is not None and t.new_tokens == 0:
                t.last_hidden = past.last_hidden

    @property
    def done(self) -> bool:
        return all(t.finished for t in self.tracks)

    def run(self) -> None:
        while not self.done:
            self.step()

    def step(self) -> None:
        """Compute one round; a no-op when every track is finished."""
        pieces = [p for t in self.tracks if not t.finished if (p := self._plan(t)) is not None]
        if pieces:
            self._forward(pieces)

    def _plan(self, t: Track) -> _Piece | None:
        cfg = self.model.cfg
        hist_len = min(self._block_size(t.history.past_tokens + t.done_tokens),
                       t.new_tokens - t.done_tokens)
        cand_len = 0
        if t.candidates is not None and t.done_tokens + hist_len == t.new_tokens:
            cand_len = min(self._candidate_block_size(t.history.total_tokens),
                           int(t.candidates.numel()) - t.done_candidates)
        piece = _Piece(t, t.done_tokens, hist_len, t.done_candidates, cand_len)
        if t.key_ts is not None:
            past = t.history.past_tokens
            if hist_len:
                end = past + t.done_tokens + hist_len
                assert t.query_times is not None
                q_ts = t.query_times[past + t.done_tokens:end].flip(0)
                bucket = time_buckets_sorted if t.time_ordered else time_buckets
                piece.hist_buckets = bucket(q_ts, t.key_ts[:end], cfg.num_time_buckets)
            if cand_len:
                assert t.query_ts is not None
                q = torch.tensor([t.query_ts], device=t.key_ts.device)
                late = t.time_ordered and t.query_ts >= int(t.key_ts[-1])
                bucket = time_buckets_sorted if late else time_buckets
                piece.cand_buckets = bucket(q, t.key_ts, cfg.num_time_buckets)[0]
        return piece

    def _block_size(self, start: int) -> int:
        """Query block for a chunk starting at ``start``: its scores fit ``score_block_elems``
        where the kernel makes them whole (``AttentionKernel.score_budget``), and the pass's
        ``round_scores`` where it has one."""
        cfg = self.model.cfg
        fit = self._block_budget // (cfg.num_heads * (start + cfg.query_block))
        # never past query_block: the position bias view is padded for that many queries
        return min(cfg.query_block, max(_MIN_BLOCK, fit - fit % _MIN_BLOCK))

    def _candidate_block_size(self, keys: int) -> int:
        """Candidates per micro-batch against ``keys`` history keys: at most ``candidate_block``,
        and, where the kernel makes their scores whole, few enough that those (heads x
        candidates x keys) fit ``score_block_elems``. A larger score matrix leaves the cache and,
        past the allocator's mmap threshold, is mapped and faulted in afresh on every layer.
        (A ranking batch runs whole, so ``round_scores`` does not apply.)"""
        cfg = self.model.cfg
        fit = self._candidate_budget // (cfg.num_heads * max(keys, 1))
        return max(1, min(cfg.candidate_block, fit))

    def _embed(self, pieces: list[_Piece]) -> Tensor:
        model = self.model
        rows: list[Tensor] = []
        for p in pieces:
            t, past = p.track, p.track.history.past_tokens
            if p.hist_len:
                ids = t.history.items[p.hist_start:p.hist_start + p.hist_len]
                first = past + p.hist_start
                positions = torch.arange(first, first + p.hist_len, device=ids.device)
                rows.append(model.embed_history(ids, positions))
            if p.cand_len:
                assert t.candidates is not None
                ids = t.candidates[p.cand_start:p.cand_start + p.cand_len]
                rows.append(model.embed_candidates(ids, t.history.total_tokens))
        return torch.cat(rows)

    def _forward(self, pieces: list[_Piece]) -> None:
        model = self.model
        x = model.input_dropout(self._embed(pieces))            # [R, d], R rows in the round
        for layer_index, layer in enumerate(model.blocks):
            x = layer(x, functools.partial(self._attend, pieces, layer_index, layer))
        self._collect(pieces, model.final_norm(x))

    def _attend(self, pieces: list[_Piece], layer_index: int, layer: HSTULayer, q: Tensor,
                k: Tensor, v: Tensor) -> Tensor:
        """``layer``'s attention for the round's rows (``Attend``): ``q``, ``k``, ``v`` ``[R,
        d]`` in the order of ``pieces``. Each piece's history rows store their keys and values
        in its track, then attend over the track's segments; its candidate rows attend over the
        whole history and themselves."""
        cfg = self.model.cfg
        heads, dh, norm = cfg.num_heads, cfg.head_dim, cfg.normalizer
        attn = torch.empty_like(q)
        w_rev = self._pos_w_rev.get(layer_index)
        if w_rev is None:
            w_rev = self._pos_w_rev[layer_index] = reversed_padded(layer.pos_w, cfg.query_block)
        row = 0
        for p in pieces:
            t = p.track
            if p.hist_len:
                n, s_new = p.hist_len, p.hist_start
                rows = slice(row, row + n)
                new = slice(s_new, s_new + n)
                # [n, d] → [H, n, dh]
                t.k[layer_index, :, new] = k[rows].view(n, heads, dh).transpose(0, 1)
                t.v[layer_index, :, new] = v[rows].view(n, heads, dh).transpose(0, 1)
                q_rev = q[rows].view(n, heads, dh).transpose(0, 1).flip(1)
                start = t.history.past_tokens + s_new
                bias = toeplitz_reversed(w_rev, start, n, start + n, cfg.max_seq_len)
                time = None if p.hist_buckets is None else TimeBias(layer.time_w, p.hist_buckets)
                out = self.kernel.history(q_rev, t.segments(layer_index, s_new + n), bias, time,
                                          norm)
                attn[rows] = out.transpose(0, 1).reshape(n, cfg.dim)
                row += n
            if p.cand_len:
                c = p.cand_len
                rows = slice(row, row + c)
                total = t.history.total_tokens
                # every candidate sits at position `total`: bias row w[total - j], j < total
                bias_vec = layer.pos_w[1:total + 1].flip(0)
                if p.cand_buckets is not None:
                    bias_vec = bias_vec + layer.time_bias(p.cand_buckets)
                heads_view = (c, heads, dh)
                out = self.kernel.candidates(
                    q[rows].view(heads_view).transpose(0, 1),
                    k[rows].view(heads_view).transpose(0, 1),
                    v[rows].view(heads_view).transpose(0, 1),
                    t.segments(layer_index, t.new_tokens), bias_vec,
                    layer.self_bias(p.cand_buckets is not None), norm)
                attn[rows] = out.transpose(0, 1).reshape(c, cfg.dim)
                row += c
        return attn

    def _collect(self, pieces: list[_Piece], h: Tensor) -> None:
        row = 0
        for p in pieces:
            t = p.track
            if p.hist_len:
                kept_last = t.new_tokens - 2          # the last token ``kept`` reuses
                if t.history.next_ts is not None and \
                        p.hist_start <= kept_last < p.hist_start + p.hist_len:
                    t.kept_hidden = h[row + kept_last - p.hist_start].clone()
                row += p.hist_len
                t.done_tokens += p.hist_len
                if t.done_tokens == t.new_tokens:
                    t.last_hidden = h[row - 1].clone()
            if p.cand_len:
                assert t.candidates is not None and t.last_hidden is not None
                ids = t.candidates[p.cand_start:p.cand_start + p.cand_len]
                prior = self.model.rank_prior(t.last_hidden, ids)
                t.scores.append(self.model.rank_logits(h[row:row + p.cand_len], prior))
                row += p.cand_len
                t.done_candidates += p.cand_len
