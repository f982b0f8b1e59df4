"""The cascade's earlier stages: retrieval and pre-processing, on their own (simulated) fleets.

They do not run on the ranking device: their compute (a retrieval strategy's user vector and
FAISS search, a filter; ``relaygr.cascade.proposals``) runs on a separate thread pool, and the
two stages together last at least their configured delays, which stand for the time those
fleets take in production. That window is what pre-inference hides in. With a trained
retrieval stage the delays default to 0 (``MEASURED_STAGE_DELAYS``): the request then waits
for the measured retrieval alone. ``StageTiming`` says which of the two a request waited for.
Pre-processing drops the items the user has seen; where that leaves fewer than the request's
candidates and the strategy can leave ids out of its search (``ExcludingStage``), retrieval is
asked again without them, so a user with a long history still gets a full list of unseen
items. A user who has seen every item retrieval can propose gets ``NoCandidatesError`` before
any ranking work is queued. Both stages are deterministic, so every mode ranks the same
candidates. The candidates keep
the strategy's score of each (``StageOutput.scores``), which the cascade may fuse with the
ranker's after ranking (``StagesConfig.stage_weight``); a book keeps them too.

A benchmark keeps the other fleets' compute off the machine it measures: it runs retrieval for
every scheduled visit before the point starts (``CandidateBook``, same function, same inputs)
and the stages then only take their configured delay. A visit the book does not hold exactly
(same user, same history) is retrieved live, so a replay can be slower, never different.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import Tensor

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.proposals import EmbeddingRetrieval, ExcludingStage, RetrievalStage
from relaygr.errors import EmptyInputError, NoCandidatesError
from relaygr.model import HSTU
from relaygr.wake import sleep_until


class CandidateBook:
    """Retrieval results computed ahead of time, by user and exact history (module docstring).

    An entry is found by a hash of the history and then checked against the whole history, so a
    hash collision is a miss (live retrieval), never another visit's candidates.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int, int], tuple[bytes, Tensor, Tensor]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _events(history: np.ndarray) -> bytes:
        return np.ascontiguousarray(history, dtype=np.int64).tobytes()

    def add(self, user_id: int, history: np.ndarray, num_candidates: int,
            candidates: Tensor, scores: Tensor) -> None:
        """``scores``: the stage's score of each candidate (``EarlierStages.candidates``' pair)."""
        events = self._events(history)
        self._entries[(user_id, num_candidates, hash(events))] = (events, candidates, scores)

    def get(self, user_id: int, history: np.ndarray, num_candidates: int
            ) -> tuple[Tensor, Tensor] | None:
        """The candidates and their stage scores, or None: a miss."""
        events = self._events(history)
        found = self._entries.get((user_id, num_candidates, hash(events)))
        return found[1:] if found is not None and found[0] == events else None


@dataclass(frozen=True)
class StageTiming:
    """Where a request's time went before ranking, in seconds: intervals of one clock
    (``EarlierStages.clock``, ``time.perf_counter`` as the rest of a ``Recommendation``),
    disjoint and in order, so their sum never exceeds the request's time.

    ``retrieval_s``: measured, from handing the request to the retrieval pool to its candidates
    back on the event loop (the strategy's user vector and index search, pre-processing's
    filter, any wait for a pool thread); about 0 when the candidates were replayed from a book.
    ``delay_s``: then slept for the configured stage delays (the simulated fleets' time) beyond
    that; 0 when the delays are 0 or the measured work already took longer."""

    retrieval_s: float
    delay_s: float
    replayed: bool = False


@dataclass(frozen=True)
class StageOutput:
    """The candidates pre-processing kept (``[<= num_candidates]`` dense ids, the stage's order),
    the stage's score of each (float32, same shape), and their time."""

    candidates: Tensor
    timing: StageTiming
    scores: Tensor


class EarlierStages:
    """Retrieval then pre-processing for one request (see the module docstring)."""

    def __init__(self, retrieval: RetrievalStage, retrieval_k: int, retrieval_delay_s: float,
                 preprocess_delay_s: float, book: CandidateBook | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock`` measures ``StageTiming`` (the delays run on the event loop's timers, whose
        clock may be coarse: uvloop's counts milliseconds)."""
        self.retrieval = retrieval
        self.clock = clock
        self.retrieval_k = retrieval_k
        self.retrieval_delay_s = retrieval_delay_s
        self.preprocess_delay_s = preprocess_delay_s
        self.book = book
        self.replayed = self.retrieved = 0     # visits answered from the book / computed
        # visits retrieved again without their seen items (too few unseen ones at first)
        self.refilled = 0
        self._excludes = "exclude" in inspect.signature(retrieval.scored).parameters
        self._fleet = ThreadPoolExecutor(max_workers=2, thread_name_prefix="relaygr-retrieval")

    @classmethod
    def of(cls, config: SystemConfig, model: HSTU, retrieval: RetrievalStage | None = None,
           book: CandidateBook | None = None) -> EarlierStages:
        """The stages ``config`` sets (K, delays), retrieving with ``retrieval`` as given (a
        trained run as served: ``trained_retrieval.beside_the_default``), default the ranking
        model's item embeddings (``EmbeddingRetrieval``): one construction for every transport
        (the embedded system, the Ray ingress, the benchmark)."""
        stages = config.stages
        return cls(retrieval or EmbeddingRetrieval.of(model, stages.retrieval_history,
                                                      recency=stages.retrieval_recency),
                   stages.retrieval_k, stages.retrieval_delay_ms / 1e3,
                   stages.preprocess_delay_ms / 1e3, book)

    def candidates(self, history: np.ndarray, num_candidates: int,
                   user_id: int | None = None) -> tuple[Tensor, Tensor]:
        """The top items not already in the history, best first (``[<= num_candidates]``),
        and the stage's score of each (float32)."""
        if history.size == 0:
            raise EmptyInputError("retrieval needs at least one event in the user's history")
        ids, scores = self.retrieval.scored(history, self.retrieval_k, user_id)
        fresh = ~np.isin(ids, history)                       # pre-processing: filter
        if fresh.sum() < num_candidates and self._excludes:
            # most of what was proposed is seen: retrieve again, the seen items left out
            ids, scores = cast(ExcludingStage, self.retrieval).scored(
                history, self.retrieval_k, user_id, exclude=np.unique(history))
            fresh = ~np.isin(ids, history)
            self.refilled += 1
        if not fresh.any():
            raise NoCandidatesError(
                f"retrieval found no item this user has not seen ({len(ids)} proposed, the "
                f"history holds {len(np.unique(history))} distinct items): nothing to rank")
        kept = np.ascontiguousarray(ids[fresh][:num_candidates])          # ... truncate
        return (torch.from_numpy(kept),
                torch.from_numpy(np.ascontiguousarray(scores[fresh][:num_candidates],
                                                      dtype=np.float32)))

    async def run(self, history: np.ndarray, num_candidates: int, user_id: int | None = None,
                  arrived: float | None = None) -> StageOutput:
        """Both stages: done no earlier than their configured total after the request
        ``arrived`` (the event loop's time; default: the call), and no later than that plus
        timer granularity (one absolute deadline, not two sleeps), or when the measured work
        is done if that is later. Their fleets start on the request when it arrives, beside
        the pre-infer signal, so the signal's own work is not added to their time. The book's
        answer is used when it holds ``user_id`` with exactly this history."""
        loop = asyncio.get_running_loop()
        start = self.clock()
        deadline = (loop.time() if arrived is None else arrived) \
            + self.retrieval_delay_s + self.preprocess_delay_s
        found = None
        if self.book is not None and user_id is not None:
            found = self.book.get(user_id, history, num_candidates)
        replayed = found is not None
        if found is None:
            found = await loop.run_in_executor(self._fleet, self.candidates, history,
                                               num_candidates, user_id)
            self.retrieved += 1
        else:
            self.replayed += 1
        candidates, scores = found
        retrieved = self.clock()
        delay_s = 0.0
        if deadline > loop.time():
            await sleep_until(deadline)     # not asyncio's timer: it ends up to 1 ms late
            delay_s = self.clock() - retrieved
        return StageOutput(candidates, StageTiming(retrieved - start, delay_s, replayed), scores)

    def shutdown(self) -> None:
        self._fleet.shutdown(wait=True)
