"""The cascade's retrieval stage: a strategy behind one small interface (``RetrievalStage``).

A strategy proposes items for a user from the user's events: up to ``k`` distinct item ids of
the *ranker* (dense, 1-based), best first, with its score of each (``scored``: what the cascade
may fuse with the ranker's score, ``StagesConfig.stage_weight``). It may propose items the user
has already seen; pre-processing (``EarlierStages``) filters those and keeps the candidates.
Strategies are deterministic (same events, same proposals) and safe to call from the retrieval
pool's threads concurrently once built.

- ``EmbeddingRetrieval``: the ranking model's own item embeddings in a FAISS index, the user
  vector the normalised, recency-weighted mean of the embeddings of the user's latest events (a
  two-tower-style proxy that needs no ranking-model pass). The default.
- ``TrainedRetrieval`` (``relaygr.cascade.trained_retrieval``): a trained retrieval run's towers.
- ``HSTURunRetrieval`` (``relaygr.cascade.hstu_retrieval``): another HSTU run's retrieval head.
- ``ItemCFRetrieval`` (``relaygr.cascade.item_cf``): item-to-item collaborative filtering.
- ``InterleavedRetrieval``: two or more of them as channels of one list, each holding its share
  of every prefix of it (``StagesConfig.retrieval_shares``: a trained run and its item-to-item
  channel beside the default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from relaygr.cascade.retrieval import Retriever
from relaygr.errors import ConfigError, EmptyInputError
from relaygr.model import HSTU


class RetrievalStage(Protocol):
    """Proposes ranker item ids for a user (see the module docstring)."""

    @property
    def name(self) -> str:
        """What serves retrieval, for logs and reports."""

    def propose(self, history: np.ndarray, k: int, user_id: int | None = None) -> np.ndarray:
        """``(<= k,)`` int64 distinct dense ranker ids, best first, from ``history`` (the user's
        events, dense ranker ids, oldest first; at least one). ``user_id`` is the cascade's id
        of the user (a strategy may use it; None: unknown)."""

    def scored(self, history: np.ndarray, k: int, user_id: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """``propose``'s ids and the strategy's score of each: ``((<= k,) int64, (<= k,)
        float32)``, the scores non-increasing."""


class ExcludingStage(RetrievalStage, Protocol):
    """A strategy that can leave given ids out of its search (an offline cascade removes the
    user's whole history; serving leaves that to pre-processing)."""

    def scored(self, history: np.ndarray, k: int, user_id: int | None = None,
               exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``RetrievalStage.scored``, none of the ids in ``exclude`` among the proposals."""


class EmbeddingRetrieval:
    """FAISS over the ranking model's item embeddings; user = recency-weighted mean of its
    latest events' embeddings."""

    name = "item-embeddings"

    def __init__(self, model: HSTU, retriever: Retriever, recent_events: int, *,
                 recency: float) -> None:
        """``recent_events``: how many of the latest events form the user vector; ``recency``
        in (0, 1]: the k-th newest of them weighs ``recency ** k`` (1: their plain mean)."""
        if recent_events < 1 or not 0 < recency <= 1:
            raise ConfigError(f"EmbeddingRetrieval needs recent_events >= 1 and recency in "
                              f"(0, 1], got {recent_events} and {recency}")
        self.embeddings = model.item_emb.weight.detach().to("cpu", torch.float32)
        self.retriever = retriever
        self.recent_events = recent_events
        self.recency = recency

    @classmethod
    def of(cls, model: HSTU, recent_events: int, *, recency: float) -> EmbeddingRetrieval:
        """``recent_events`` and ``recency`` as ``StagesConfig.retrieval_history`` and
        ``retrieval_recency`` (no defaults here: the config holds them)."""
        return cls(model, Retriever.from_model(model), recent_events, recency=recency)

    def user_vector(self, history: np.ndarray) -> Tensor:
        """``[1, d]``: the normalised, recency-weighted mean embedding of the last
        ``recent_events`` events."""
        recent = torch.from_numpy(np.ascontiguousarray(history[-self.recent_events:]))
        newest_first = torch.arange(len(recent) - 1, -1, -1, dtype=torch.float32)
        vec = ((self.recency ** newest_first) @ self.embeddings[recent])[None]
        return vec / vec.norm().clamp_min(1e-12)

    def propose(self, history: np.ndarray, k: int, user_id: int | None = None) -> np.ndarray:
        return self.scored(history, k, user_id)[0]

    def scored(self, history: np.ndarray, k: int, user_id: int | None = None,
               exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The index's top ``k`` with their inner products with the user vector, none of the ids
        in ``exclude`` (e.g. the whole history, as an offline cascade removes it) among them."""
        if history.size == 0:
            raise EmptyInputError("retrieval needs at least one event in the user's history")
        skip = None if exclude is None or not len(exclude) else [np.unique(exclude)]
        # up to k: a catalogue smaller than k is retrieved whole
        most = self.retriever.num_items - (0 if skip is None else len(skip[0]))
        if min(k, most) < 1:                 # nothing asked for, or every item excluded
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        found = self.retriever.search(self.user_vector(history), min(k, most), skip)
        valid = found.valid[0]
        return found.item_ids[0][valid], found.scores[0][valid]


class InterleavedRetrieval:
    """Channels (strategies) merged into one list in which every prefix holds each channel's
    share of its length, to within one item: position ``p`` goes to the channel furthest below
    its share of ``p + 1`` (ties to the earlier channel), which gives its best item not already
    in the list; a channel with none left yields its places to the others. The user's own
    events are left out of every channel's search (as pre-processing would drop them), so the
    shares hold among the candidates pre-processing keeps, however many it keeps (the first
    ``num_candidates`` of ``retrieval_k``), which a concatenation of the channels' lists would
    not give. A channel that cannot read the user's events (``EmptyInputError``: none of them
    is an item it knows) proposes nothing, and the others fill the list; only when every
    channel fails does the user get the error.

    The channels score on scales of their own, so the merged list's score of the item at
    position ``p`` is its reciprocal rank ``1 / (p + 1)``: an order, not a score to fuse with the
    ranker's (``trained_retrieval.check_run_share`` refuses a stage weight with it)."""

    def __init__(self, channels: Sequence[tuple[ExcludingStage, float]]) -> None:
        """``channels``: ``(strategy, share)`` pairs, shares in (0, 1) summing to 1."""
        shares = np.array([share for _, share in channels], dtype=np.float64)
        if len(channels) < 2 or not ((shares > 0) & (shares < 1)).all() \
                or abs(shares.sum() - 1) > 1e-9:
            raise ConfigError("InterleavedRetrieval needs two or more channels with shares in "
                              f"(0, 1) summing to 1, got {shares.tolist()}")
        self.channels = [stage for stage, _ in channels]
        self.shares = shares
        self.name = " + ".join(f"{stage.name} ({share:.0%})" for stage, share in channels)
        self._orders: dict[int, np.ndarray] = {}    # by k; a race only computes one twice

    def order(self, k: int) -> np.ndarray:
        """``(k,)``, read-only: the channel of each position, before any channel runs out."""
        found = self._orders.get(k)
        if found is not None:
            return found
        owner = np.empty(k, dtype=np.int64)
        taken = np.zeros(len(self.shares))
        for p in range(k):
            c = int(np.argmax(self.shares * (p + 1) - taken))   # first of the furthest behind
            owner[p] = c
            taken[c] += 1
        owner.setflags(write=False)
        self._orders[k] = owner
        return owner

    def propose(self, history: np.ndarray, k: int, user_id: int | None = None) -> np.ndarray:
        return self.scored(history, k, user_id)[0]

    def scored(self, history: np.ndarray, k: int, user_id: int | None = None,
               exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``k`` distinct ids outside ``history`` and ``exclude``, each channel asked
        for its top ``k`` of those, and their reciprocal ranks."""
        if history.size == 0:
            raise EmptyInputError("retrieval needs at least one event in the user's history")
        events = np.asarray(history, dtype=np.int64)
        skip = events if exclude is None else np.union1d(events, exclude)
        lists: list[list[int]] = []
        refused: EmptyInputError | None = None
        for stage in self.channels:
            try:
                lists.append(stage.scored(events, k, user_id, exclude=skip)[0].tolist())
            except EmptyInputError as error:      # this channel knows none of the events
                lists.append([])
                refused = error
        if refused is not None and not any(lists):
            raise refused
        merged = _merge(lists, self.order(k))
        ranks = np.arange(1, len(merged) + 1, dtype=np.float32)
        return np.asarray(merged, dtype=np.int64), 1 / ranks


def _merge(lists: list[list[int]], order: np.ndarray) -> list[int]:
    """The channels' ``lists`` (best first) merged position by position as ``order`` assigns
    (``InterleavedRetrieval``), each item once."""
    nexts = [0] * len(lists)
    merged: list[int] = []
    chosen: set[int] = set()

    def take(c: int) -> bool:
        """Channel ``c``'s best item not yet chosen, appended; False: it has none left."""
        ids, i = lists[c], nexts[c]
        while i < len(ids) and ids[i] in chosen:
            i += 1
        if i >= len(ids):
            return False
        nexts[c] = i + 1
        merged.append(ids[i])
        chosen.add(ids[i])
        return True

    for preferred in order.tolist():
        # run out, a channel yields the place to the others, in order; all run out: done
        if not take(preferred) and not any(take(c) for c in range(len(lists))):
            break
    return merged
