"""The cascade's earlier stages: retrieval and pre-processing, on their own (simulated) fleets.

They do not run on the ranking device: their compute (a FAISS search, a filter) runs on a
separate thread pool, and each stage lasts at least its configured delay, which stands for the
time those fleets take in production. That window is what pre-inference hides in.

Retrieval's user vector is the normalised mean of the item embeddings of the user's latest
events (a two-tower-style proxy): it needs no ranking-model pass, so retrieval never waits for
the ranking device. Both stages are deterministic, so every mode ranks the same candidates.

A benchmark keeps the other fleets' compute off the machine it measures: it runs retrieval for
every scheduled visit before the point starts (``CandidateBook``, same function, same inputs)
and the stages then only take their configured delay. A visit the book does not hold exactly
(same user, same history) is retrieved live, so a replay can be slower, never different.
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


class CandidateBook:
    """Retrieval results computed ahead of time, by user and exact history (module docstring).

    An entry is found by a hash of the history and then checked against the whole history, so a
    hash collision is a miss (live retrieval), never another visit's candidates.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int, int], tuple[bytes, Tensor]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _events(history: np.ndarray) -> bytes:
        return np.ascontiguousarray(history, dtype=np.int64).tobytes()

    def add(self, user_id: int, history: np.ndarray, num_candidates: int,
            candidates: Tensor) -> None:
        events = self._events(history)
        self._entries[(user_id, num_candidates, hash(events))] = (events, candidates)

    def get(self, user_id: int, history: np.ndarray, num_candidates: int) -> Tensor | None:
        events = self._events(history)
        found = self._entries.get((user_id, num_candidates, hash(events)))
        return found[1] if found is not None and found[0] == events else None


class EarlierStages:
    """Retrieval then pre-processing for one request (see the module docstring)."""

    def __init__(self, model: HSTU, retriever: Retriever, retrieval_k: int,
                 retrieval_history: int, retrieval_delay_s: float,
                 preprocess_delay_s: float, book: CandidateBook | None = None) -> None:
        self.embeddings = model.item_emb.weight.detach().to("cpu", torch.float32)
        self.retriever = retriever
        self.retrieval_k = retrieval_k
        self.retrieval_history = retrieval_history
        self.retrieval_delay_s = retrieval_delay_s
        self.preprocess_delay_s = preprocess_delay_s
        self.book = book
        self.replayed = self.retrieved = 0     # visits answered from the book / computed
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
        # up to retrieval_k: a catalogue smaller than k is retrieved whole
        k = min(self.retrieval_k, self.retriever.num_items)
        found = self.retriever.search(self.user_vector(history), k)
        ids = found.item_ids[0][found.valid[0]]
        fresh = ids[~np.isin(ids, history)]                 # pre-processing: filter
        return torch.from_numpy(np.ascontiguousarray(fresh[:num_candidates]))   # ... truncate

    async def run(self, history: np.ndarray, num_candidates: int, user_id: int | None = None
                  ) -> Tensor:
        """Both stages: done no earlier than their configured total after the call, and no
        later than that plus timer granularity (one absolute deadline, not two sleeps). The
        book's answer is used when it holds ``user_id`` with exactly this history."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retrieval_delay_s + self.preprocess_delay_s
        candidates = None
        if self.book is not None and user_id is not None:
            candidates = self.book.get(user_id, history, num_candidates)
        if candidates is None:
            candidates = await loop.run_in_executor(self._fleet, self.candidates, history,
                                                    num_candidates)
            self.retrieved += 1
        else:
            self.replayed += 1
        await asyncio.sleep(max(0.0, deadline - loop.time()))
        return candidates

    def shutdown(self) -> None:
        self._fleet.shutdown(wait=True)
