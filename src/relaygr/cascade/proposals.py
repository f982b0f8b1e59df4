"""The cascade's retrieval stage: a strategy behind one small interface (``RetrievalStage``).

A strategy proposes items for a user from the user's events: up to ``k`` distinct item ids of
the *ranker* (dense, 1-based), best first, with its score of each (``scored``: what the cascade
may fuse with the ranker's score, ``StagesConfig.stage_weight``). It may propose items the user
has already seen; pre-processing (``EarlierStages``) filters those and keeps the candidates.
Strategies are deterministic (same events, same proposals) and safe to call from the retrieval
pool's threads concurrently once built.

- ``EmbeddingRetrieval``: the ranking model's own item embeddings in a FAISS index, the user
  vector the normalised mean of the embeddings of the user's latest events (a two-tower-style
  proxy that needs no ranking-model pass). The default.
- ``TrainedRetrieval`` (``relaygr.cascade.trained_retrieval``): a trained retrieval run's towers.
- ``HSTURunRetrieval`` (``relaygr.cascade.hstu_retrieval``): another HSTU run's retrieval head.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from relaygr.cascade.retrieval import Retriever
from relaygr.errors import EmptyInputError
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
    """FAISS over the ranking model's item embeddings; user = mean of recent embeddings."""

    name = "item-embeddings"

    def __init__(self, model: HSTU, retriever: Retriever, recent_events: int) -> None:
        """``recent_events``: how many of the latest events form the user vector."""
        self.embeddings = model.item_emb.weight.detach().to("cpu", torch.float32)
        self.retriever = retriever
        self.recent_events = recent_events

    @classmethod
    def of(cls, model: HSTU, recent_events: int) -> EmbeddingRetrieval:
        return cls(model, Retriever.from_model(model), recent_events)

    def user_vector(self, history: np.ndarray) -> Tensor:
        """``[1, d]``: normalised mean embedding of the last ``recent_events`` events."""
        recent = torch.from_numpy(np.ascontiguousarray(history[-self.recent_events:]))
        vec = self.embeddings[recent].mean(0, keepdim=True)
        return vec / vec.norm().clamp_min(1e-12)

    def propose(self, history: np.ndarray, k: int, user_id: int | None = None) -> np.ndarray:
        return self.scored(history, k, user_id)[0]

    def scored(self, history: np.ndarray, k: int, user_id: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """The index's top ``k`` with their inner products with the user vector."""
        if history.size == 0:
            raise EmptyInputError("retrieval needs at least one event in the user's history")
        # up to k: a catalogue smaller than k is retrieved whole
        found = self.retriever.search(self.user_vector(history), min(k, self.retriever.num_items))
        valid = found.valid[0]
        return found.item_ids[0][valid], found.scores[0][valid]
