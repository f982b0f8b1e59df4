"""The cascade's earlier stages: retrieval and pre-processing, on their own (simulated) fleets.

They do not run on the ranking device: their compute (a FAISS search, a filter) runs on a
separate thread pool, and each stage lasts at least its configured delay, which stands for the
time those fleets take in production. That window is what pre-inference hides in.

Retrieval's user vector is the normalised mean of the item embeddings of the user's latest
events (a two-tower-style proxy): it needs no ranking-model pass, so retrieval never waits for
the ranking device. Both stages are deterministic, so every mode ranks the same candidates.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from relaygr.cascade.retrieval import Retriever
from relaygr.errors import EmptyInputError
from relaygr.model import HSTU


class EarlierStages:
    """Retrieval then pre-processing for one request (see the module docstring)."""

    def __init__(self, model: HSTU, retriever: Retriever, retrieval_k: int,
                 retrieval_history: int, retrieval_delay_s: float,
                 preprocess_delay_s: float) -> None:
        self.embeddings = model.item_emb.weight.detach().to("cpu", torch.float32)
        self.retriever = retriever
        self.retrieval_k = retrieval_k
        self.retrieval_history = retrieval_history
        self.retrieval_delay_s = retrieval_delay_s
        self.preprocess_delay_s = preprocess_delay_s
        self._fleet = ThreadPoolExecutor(max_workers=2, thread_name_prefix="relaygr-retrieval")

    def user_vector(self, history: np.ndarray) -> Tensor:
        """``[1, d]``: normalised mean embedding of the last ``retrieval_history`` events."""
        recent = torch.from_numpy(np.ascontiguousarray(history[-self.retrieval_history:]))
        vec = self.embeddings[recent].mean(0, keepdim=True)
        return vec / vec.norm().clamp_min(1e-12)

    def candidates(self, history: np.ndarray, num_candidates: int) -> Tensor:
        """The top items not already in the history, best first (``[<= num_candidates]``)."""
        if history.size == 0:
            raise EmptyInputError("retrieval needs at least one event in the user's history")
        found = self.retriever.search(self.user_vector(history), self.retrieval_k)
        ids = found.item_ids[0][found.valid[0]]
        fresh = ids[~np.isin(ids, history)]                 # pre-processing: filter
        return torch.from_numpy(np.ascontiguousarray(fresh[:num_candidates]))   # ... truncate

    async def run(self, history: np.ndarray, num_candidates: int) -> Tensor:
        """Both stages: done no earlier than their configured total after the call, and no
        later than that plus timer granularity (one absolute deadline, not two sleeps)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retrieval_delay_s + self.preprocess_delay_s
        candidates = await loop.run_in_executor(self._fleet, self.candidates, history,
                                                num_candidates)
        await asyncio.sleep(max(0.0, deadline - loop.time()))
        return candidates

    def shutdown(self) -> None:
        self._fleet.shutdown(wait=True)
