"""The HSTU ranking model: embeddings, a stack of HSTU layers, a ranking and a retrieval head.

Serving API (what the relay uses)::

    kv = model.prefill(items, timestamps=None, past=None)          # PrefixKV of the history
    scores = model.rank(candidates, prefix=kv, suffix_items=...)   # [C], from the cache
    scores = model.rank(candidates, prefix_items=items, ...)       # [C], full pass, same scores

Both run through ``passes.Pass`` (chunked, jagged, exact with respect to caching). Training uses
``encode_padded`` / ``rank_padded``: the same function computed densely over padded batches.

Token layout of a ranking request: history positions 0..N-1 (prefix, then suffix), and every
candidate at position N. A history token sees the history up to itself; a candidate sees the whole
history and itself, never another candidate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relaygr.errors import EmptyInputError, InvalidInputError, TimestampError
from relaygr.model.attention import (
    dense_attention,
    following_timestamps,
    last_timestamps,
    time_buckets,
)
from relaygr.model.config import HSTUConfig
from relaygr.model.fused import AttentionKernel, attention_kernel
from relaygr.model.inputs import (
    IntSeq,
    PrefillInput,
    RankInput,
    check_item_range,
    validate_prefill,
    validate_rank,
)
from relaygr.model.kv import PrefixKV
from relaygr.model.layers import HSTULayer
from relaygr.model.passes import Pass, Track
from relaygr.model.warmup import warm_up

# Guards the L2 normalisation of cosine retrieval against a zero vector (the padding row).
_L2_EPS = 1e-6


@dataclass(frozen=True)
class CandidateStates:
    """What the ranking head reads in the dense path: ``candidates`` ``[B, C, d]``, the final
    states of the candidate tokens, and ``user`` ``[B, d]``, the final state of each history's
    last token (what ``PrefixKV.last_hidden`` holds in the serving path)."""

    candidates: Tensor
    user: Tensor


@dataclass(frozen=True)
class RankOutput:
    """Scores ``[C]`` and the K/V of the history tokens this ranking pass computed that a later
    pass can reuse (``Track.kept``; None when none: the whole history came from the cache).
    ``concat_prefix(prefix, computed)`` is a prefix of the next visit's history once these events
    are appended to the user's. It is the whole history, except under ``time_query="next"``:
    there the last token was computed for this request's time, which the next visit's events do
    not continue, so it stops one token short, recorded as continuing at that token's time."""

    scores: Tensor
    computed: PrefixKV | None


class HSTU(nn.Module):
    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.item_emb = nn.Embedding(cfg.num_items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(cfg.max_seq_len + 1, d)   # absolute positions 0..max_seq_len
        self.candidate_type = nn.Parameter(torch.zeros(d))     # marks a token as a ranking target
        self.input_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(HSTULayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm: nn.Module = nn.LayerNorm(d) if cfg.final_norm else nn.Identity()
        self.rank_head = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 1))
        self._attention_kernel = attention_kernel(cfg.attention, cfg.attention_tile_elems)
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.normal_(self.item_emb.weight, std=0.02)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()
        if self.cfg.reference_layers:
            # the open-source HSTU's reset_params re-initialises its position table so
            nn.init.xavier_normal_(self.pos_emb.weight)
        else:
            nn.init.normal_(self.pos_emb.weight, std=0.02)
        nn.init.normal_(self.candidate_type, std=0.02)
        for layer in self.blocks:
            layer.init_weights()

    # ---- building blocks -------------------------------------------------------------------

    @property
    def blocks(self) -> list[HSTULayer]:
        """The HSTU layers, typed (``self.layers`` is an ``nn.ModuleList``)."""
        return [cast(HSTULayer, layer) for layer in self.layers]

    @property
    def attention_kernel(self) -> AttentionKernel:
        """How the serving passes compute attention (``HSTUConfig.attention``)."""
        return self._attention_kernel

    def describe_attention(self) -> str:
        """The attention kernel that runs on the model's device (and why, if it fell back)."""
        return self._attention_kernel.describe(self.device)

    def warm_up(self) -> str:
        """Run each kind of serving pass once (``warmup.warm_up``), so that nothing is compiled
        on a request's time; returns ``describe_attention()``. Call it before the model serves
        (it swaps the attention kernel while it runs)."""
        warm_up(self)
        return self.describe_attention()

    def use_attention_kernel(self, kernel: AttentionKernel) -> AttentionKernel:
        """Make ``kernel`` the serving passes' attention; returns the one it replaces."""
        previous, self._attention_kernel = self._attention_kernel, kernel
        return previous

    @property
    def device(self) -> torch.device:
        return self.item_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.item_emb.weight.dtype

    def embed_history(self, items: Tensor, positions: Tensor) -> Tensor:
        """``[T]`` ids at ``[T]`` positions → ``[T, d]`` input tokens."""
        return self.item_emb(items) * math.sqrt(self.cfg.dim) + self.pos_emb(positions)

    def embed_candidates(self, items: Tensor, position: int) -> Tensor:
        """``[C]`` candidate ids, all at ``position`` (the history length) → ``[C, d]``."""
        pos = self.pos_emb.weight[position]
        return self.item_emb(items) * math.sqrt(self.cfg.dim) + pos + self.candidate_type

    # ---- retrieval head: logits = retrieval_query(user) · item vector -----------------------

    def _retrieval_vectors(self, emb: Tensor) -> Tensor:
        if self.cfg.cosine_retrieval:
            return F.normalize(emb, dim=-1, eps=_L2_EPS)
        return emb

    def item_vectors(self, ids: Tensor) -> Tensor:
        """``[...]`` item ids → ``[..., d]`` the vectors retrieval scores users against
        (the item embeddings, L2-normalised under cosine similarity)."""
        return self._retrieval_vectors(self.item_emb(ids))

    def item_embeddings(self) -> Tensor:
        """``[num_items, d]``: retrieval vectors of ids 1..num_items (row i is id i + 1), so
        ``retrieval_query(user) @ item_embeddings().T`` are the logits of every item."""
        return self._retrieval_vectors(self.item_emb.weight[1:])

    def retrieval_query(self, user: Tensor) -> Tensor:
        """``[..., d]`` user representations (``PrefixKV.last_hidden``, ``encode_padded``
        outputs) → ``[..., d]`` query vectors, normalised and divided by the temperature."""
        return self._retrieval_vectors(user) / self.cfg.retrieval_temperature

    def retrieval_scores(self, user: Tensor) -> Tensor:
        """``[..., d]`` user representations → ``[..., num_items + 1]`` logits (column 0 unused)."""
        return self.retrieval_query(user) @ self._retrieval_vectors(self.item_emb.weight).t()

    # ---- ranking head: an MLP on a candidate token's state, plus the retrieval logit ---------

    def rank_prior(self, user: Tensor, candidates: Tensor) -> Tensor | None:
        """The part of a ranking score the head's MLP does not compute: ``[..., d]`` last
        history states and ``[..., C]`` candidate ids → ``[..., C]`` retrieval logits (the
        values ``retrieval_scores`` gives those ids) under ``rank_score="retrieval_residual"``;
        None under ``"state"``."""
        if not self.cfg.rank_adds_retrieval:
            return None
        query = self.retrieval_query(user).unsqueeze(-2)                    # [..., 1, d]
        return (query * self.item_vectors(candidates)).sum(-1)             # [..., C]

    def rank_logits(self, states: Tensor, prior: Tensor | None) -> Tensor:
        """``[..., C, d]`` candidate-token final states → ``[..., C]`` scores: the head's MLP,
        plus ``prior`` (``rank_prior``) when given. The serving pass (``rank``) and the dense
        path (``rank_padded``) both score through here, so they compute the same function."""
        scores = self.rank_head(states).squeeze(-1)                         # [..., C]
        return scores if prior is None else scores + prior

    # ---- serving: prefill and rank -----------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, items: IntSeq, timestamps: IntSeq | None = None,
                past: PrefixKV | None = None, next_timestamp: int | None = None) -> PrefixKV:
        """Per-layer K/V of ``items`` (appended to ``past`` when given); ``next_timestamp``
        under ``time_query="next"`` (``PrefillInput``)."""
        return self.prefill_batch([PrefillInput(items, timestamps, past, next_timestamp)])[0]

    @torch.inference_mode()
    def prefill_batch(self, requests: Sequence[PrefillInput]) -> list[PrefixKV]:
        """Per-layer K/V of each request, computed in one pass run whole (full query blocks)."""
        job = self._prefill_pass(requests, round_scores=None)
        job.run()
        return [t.prefix() for t in job.tracks]

    def prefill_job(self, requests: Sequence[PrefillInput]) -> Pass:
        """A resumable prefill: ``step()`` computes one chunk round (the scheduler's unit of
        pre-infer work, at most ``cfg.score_block_elems`` scores a history chunk, so that a
        ranking request queued behind it waits a bounded time); when ``done``,
        ``[t.prefix() for t in job.tracks]`` are the results. Call ``step`` under
        ``torch.inference_mode()``."""
        return self._prefill_pass(requests, round_scores=self.cfg.score_block_elems)

    def _prefill_pass(self, requests: Sequence[PrefillInput], round_scores: int | None) -> Pass:
        histories = [validate_prefill(self.cfg, r, self.device, self.dtype) for r in requests]
        return Pass(self, [Track(h) for h in histories], round_scores)

    @torch.inference_mode()
    def rank(self, candidates: IntSeq, prefix: PrefixKV | None = None,
             prefix_items: IntSeq | None = None, prefix_timestamps: IntSeq | None = None,
             suffix_items: IntSeq | None = None, suffix_timestamps: IntSeq | None = None,
             query_timestamp: int | None = None) -> Tensor:
        """Scores ``[C]`` of ``candidates``; see ``RankInput`` for the arguments."""
        request = RankInput(candidates, prefix, prefix_items, prefix_timestamps,
                            suffix_items, suffix_timestamps, query_timestamp)
        return self.rank_batch([request])[0]

    @torch.inference_mode()
    def rank_batch(self, requests: Sequence[RankInput]) -> list[Tensor]:
        """Scores for several users at once (lengths may differ; batching changes no score)."""
        return [out.scores for out in self.rank_batch_outputs(requests)]

    @torch.inference_mode()
    def rank_batch_outputs(self, requests: Sequence[RankInput]) -> list[RankOutput]:
        """Like ``rank_batch``, also returning the K/V of the history tokens the pass computed
        (the suffix, or the whole history on a full pass) that a later pass can reuse
        (``RankOutput``), so the caller can keep them."""
        tracks = []
        for r in requests:
            history, candidates, query_ts = validate_rank(self.cfg, r, self.device, self.dtype)
            tracks.append(Track(history, candidates, query_ts))
        Pass(self, tracks).run()
        return [RankOutput(torch.cat(t.scores), t.kept()) for t in tracks]

    # ---- training: dense padded forward ------------------------------------------------------

    def encode_padded(self, items: Tensor, timestamps: Tensor | None = None,
                      query_timestamps: Tensor | None = None,
                      timed: Tensor | None = None) -> Tensor:
        """``[B, T]`` right-padded histories (0 = padding) → ``[B, T, d]`` final outputs.

        ``query_timestamps`` ``[B]``: the time after each history, at which it is queried (in
        training the last target's; at evaluation the held-out item's: the request time;
        default, as ``RankInput``'s: the last history timestamp). Only a model with
        ``time_query="next"`` reads it: position i's time bias measures from the time of the
        event after it, the next history item's, and at the last position this one.

        ``timed`` ``[B]`` bool (default: every row): which rows' timestamps are real. A row
        that is not has no time bias, as the serving passes compute an untimed history (data
        where some users carry no time: ``TrainConfig.time_where_known``).
        """
        hidden, _ = self._dense_forward(items, timestamps, None, query_timestamps, timed)
        return hidden

    def rank_padded(self, items: Tensor, candidates: Tensor, timestamps: Tensor | None = None,
                    query_timestamps: Tensor | None = None,
                    timed: Tensor | None = None) -> Tensor:
        """``[B, T]`` histories and ``[B, C]`` candidates → ``[B, C]`` ranking scores
        (``timed`` as ``encode_padded``'s)."""
        states = self.candidate_states_padded(items, candidates, timestamps, query_timestamps,
                                              timed)
        return self.rank_logits(states.candidates, self.rank_prior(states.user, candidates))

    def candidate_states_padded(self, items: Tensor, candidates: Tensor,
                                timestamps: Tensor | None = None,
                                query_timestamps: Tensor | None = None,
                                timed: Tensor | None = None) -> CandidateStates:
        """The final states ``rank_logits`` and ``rank_prior`` score: the candidate tokens'
        ``[B, C, d]`` and each user's last history token's ``[B, d]`` (``timed`` as
        ``encode_padded``'s)."""
        hidden, cand_hidden = self._dense_forward(items, timestamps, candidates, query_timestamps,
                                                  timed)
        assert cand_hidden is not None
        last = ((items != 0).sum(1) - 1).clamp(min=0)                        # [B]
        user = hidden[torch.arange(len(items), device=items.device), last]   # [B, d]
        return CandidateStates(cand_hidden, user)

    def _dense_forward(self, items: Tensor, timestamps: Tensor | None, candidates: Tensor | None,
                       query_ts: Tensor | None, timed: Tensor | None = None
                       ) -> tuple[Tensor, Tensor | None]:
        cfg = self.cfg
        batch, hist = items.shape
        if hist > cfg.max_seq_len:
            raise InvalidInputError(f"padded length {hist} exceeds max_seq_len {cfg.max_seq_len}")
        lengths = (items != 0).sum(1)                                       # [B]
        arange = torch.arange(hist, device=items.device)
        if not torch.equal(items != 0, arange < lengths[:, None]):
            raise InvalidInputError("histories must be right-padded with 0")
        check_item_range("items", items[items != 0], cfg.num_items)
        if candidates is not None and (candidates.dim() != 2 or candidates.shape[0] != batch
                                       or candidates.shape[1] == 0):
            raise EmptyInputError(f"candidates must be [{batch}, C >= 1], got shape "
                                  f"{tuple(candidates.shape)}")
        if query_ts is not None and timestamps is None:
            raise TimestampError("query timestamps given but the histories carry no timestamps")
        if timed is not None and (timestamps is None or timed.dtype != torch.bool
                                  or tuple(timed.shape) != (batch,)):
            raise TimestampError(f"timed must be a [{batch}] bool mask of timed histories")
        x = self.embed_history(items, arange.expand(batch, hist))           # [B, T, d]
        n_cand = 0 if candidates is None else candidates.shape[1]
        q_pos = arange.expand(batch, hist)
        if candidates is not None:
            check_item_range("candidates", candidates.reshape(-1), cfg.num_items)
            cand_x = self.item_emb(candidates) * math.sqrt(cfg.dim)
            cand_x = cand_x + self.pos_emb(lengths)[:, None] + self.candidate_type
            x = torch.cat([x, cand_x], dim=1)                               # [B, T + C, d]
            q_pos = torch.cat([q_pos, lengths[:, None].expand(batch, n_cand)], dim=1)
        total = hist + n_cand
        # visibility [B, T+C, T+C]: causal within the valid history; candidates see it and self
        k_idx = torch.arange(total, device=items.device)
        is_hist_key = (k_idx < hist)[None, None, :] & (k_idx < lengths[:, None, None])
        causal = (k_idx[:, None] >= k_idx[None, :])[None] & is_hist_key
        if n_cand:
            is_cand_q = (k_idx >= hist)[None, :, None]
            visible = torch.where(is_cand_q, is_hist_key | torch.eye(total, dtype=torch.bool,
                                                                      device=items.device), causal)
        else:
            visible = causal
        dist = (q_pos[:, :, None] - q_pos[:, None, :]).clamp(min=0)         # [B, T+C, T+C]
        buckets = self._dense_time_buckets(items, lengths, timestamps, n_cand, query_ts)
        # an untimed row has no time bias, as the serving passes leave it out
        time_rows = None if timed is None else timed[:, None, None]
        x = self.input_dropout(x)
        for layer in self.blocks:
            x = layer(x, functools.partial(self._dense_attend, layer, dist, buckets, visible,
                                           time_rows))
        h = self.final_norm(x)
        return h[:, :hist], (h[:, hist:] if n_cand else None)

    def _dense_time_buckets(self, items: Tensor, lengths: Tensor, timestamps: Tensor | None,
                            n_cand: int, query_ts: Tensor | None) -> Tensor | None:
        """``[B, T+C, T+C]`` time buckets of every (query, key) pair, None when untimed.

        Keys are at their tokens' timestamps; candidates at ``query_ts`` (default: the last
        history timestamp). A history query is at its own timestamp, or under
        ``time_query="next"`` at the next history event's, the last one at ``query_ts``, as the
        serving passes put them.
        """
        cfg = self.cfg
        if timestamps is None:
            return None
        if timestamps.shape != items.shape:
            raise TimestampError("timestamps must have the shape of items")
        if query_ts is not None and tuple(query_ts.shape) != (len(items),):
            raise TimestampError(f"query timestamps must be one per history, shape "
                                 f"({len(items)},); got {tuple(query_ts.shape)}")
        if query_ts is None:
            query_ts = last_timestamps(timestamps, lengths)
        ts = timestamps
        query_times = following_timestamps(ts, lengths, query_ts) if cfg.next_time_query else ts
        if n_cand:
            assert query_ts is not None
            cand_ts = query_ts[:, None].expand(len(items), n_cand)
            ts = torch.cat([ts, cand_ts], dim=1)
            query_times = torch.cat([query_times, cand_ts], dim=1)
        return time_buckets(query_times, ts[:, None, :], cfg.num_time_buckets)  # [B, T+C, T+C]

    def _dense_attend(self, layer: HSTULayer, dist: Tensor, buckets: Tensor | None,
                      visible: Tensor, time_rows: Tensor | None, q: Tensor, k: Tensor,
                      v: Tensor) -> Tensor:
        """``layer``'s attention over a padded batch (``Attend``): ``q``, ``k``, ``v`` ``[B, T,
        d]``, ``dist`` the ``[B, T, T]`` causal distances, ``buckets`` the time buckets or None,
        ``visible`` the ``[B, T, T]`` mask, ``time_rows`` ``[B, 1, 1]`` True for a timed row
        (None: every row timed)."""
        cfg = self.cfg
        batch, total = q.shape[:2]
        q, k, v = (t.view(batch, total, cfg.num_heads, cfg.head_dim).transpose(1, 2)
                   for t in (q, k, v))
        bias = layer.position_bias(dist)
        if buckets is not None:
            time = layer.time_bias(buckets)
            bias = bias + (time if time_rows is None else torch.where(time_rows, time, 0.0))
        out = dense_attention(q, k, v, bias[:, None], visible[:, None], cfg.normalizer)
        return out.transpose(1, 2).reshape(batch, total, cfg.dim)
