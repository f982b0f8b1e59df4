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
"""

from __future__ import annotations

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
        found = self.retriever.search(self.user_vector(history), min(k, most), skip)
        valid = found.valid[0]
        return found.item_ids[0][valid], found.scores[0][valid]
