"""The retrieval stage of an evaluated cascade: what proposes the K items the ranker orders.

A stage maps a batch of users to their best K item ids and scores (``Proposals``), best first,
never proposing an item of the user's history (the cascade does not recommend what the user
already saw). ``HeadRetrieval`` is the ranking model's own retrieval head; a separately trained
retrieval model plugs in by implementing ``RetrievalStage`` (it may ignore ``prefixes``, the
ranking model's K/V, and read ``users`` / ``histories`` instead) and registering a factory in
``RETRIEVAL_STAGES``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from relaygr.errors import ConfigError
from relaygr.model import HSTU, PrefillInput, PrefixKV


@dataclass(frozen=True)
class RetrievalQuery:
    """A batch of users to retrieve for: dense user indices ``[b]``, each user's whole history
    (dense item ids, never to be proposed) and the ranking model's prefill of it."""

    users: np.ndarray
    histories: Sequence[np.ndarray]
    prefixes: Sequence[PrefixKV]


@dataclass(frozen=True)
class Proposals:
    """``items`` ``[b, K]`` dense ids, best first, and their ``scores`` ``[b, K]``. A row may
    end with ``-inf`` scores where fewer than K items were left to propose; such entries are
    not proposals (``row(j)`` drops them)."""

    items: Tensor
    scores: Tensor

    def __post_init__(self) -> None:
        assert self.items.shape == self.scores.shape and self.items.dim() == 2, \
            f"proposals need [b, K] items and scores, got {self.items.shape} / {self.scores.shape}"

    def row(self, j: int) -> tuple[Tensor, Tensor]:
        """The real proposals of user ``j``: ``([k_j] ids, [k_j] scores)``, k_j <= K."""
        keep = self.scores[j] > -math.inf
        return self.items[j][keep], self.scores[j][keep]


class RetrievalStage(Protocol):
    """Proposes each user's best ``k`` items (see the module docstring)."""

    def propose(self, query: RetrievalQuery, k: int) -> Proposals:
        ...


class HeadRetrieval:
    """The ranking model's own retrieval head: ``retrieval_scores(PrefixKV.last_hidden)``, the
    history removed, top ``k``."""

    def __init__(self, model: HSTU) -> None:
        self.model = model

    @torch.inference_mode()
    def propose(self, query: RetrievalQuery, k: int) -> Proposals:
        """Top ``min(k, num_items)`` (a catalogue smaller than K is proposed whole)."""
        if k <= 0:
            raise ConfigError(f"retrieve-k must be positive, got {k}")
        k = min(k, self.model.cfg.num_items)
        users = torch.stack([kv.last_hidden for kv in query.prefixes])            # [b, d]
        scores = self.model.retrieval_scores(users).float()                       # [b, N + 1]
        rows = np.repeat(np.arange(len(query.histories)), [len(h) for h in query.histories])
        cols = np.concatenate([np.asarray(h, dtype=np.int64) for h in query.histories])
        scores[torch.from_numpy(rows).to(scores.device),
               torch.from_numpy(cols).to(scores.device)] = -math.inf
        scores[:, 0] = -math.inf
        top = scores.topk(k, dim=1)
        return Proposals(top.indices, top.values)


class CheckpointRetrieval:
    """Another trained HSTU's retrieval head (same item ids as the ranker): it prefills each
    user's history itself (the newest ``max_seq_len`` events), so the stage is independent of
    the ranker's layers, as a separate retrieval model in production is. Position-only models
    (the query carries no timestamps)."""

    def __init__(self, model: HSTU) -> None:
        self.model = model

    @torch.inference_mode()
    def propose(self, query: RetrievalQuery, k: int) -> Proposals:
        keep = self.model.cfg.max_seq_len
        device = self.model.device
        prefixes = self.model.prefill_batch([
            PrefillInput(torch.as_tensor(np.asarray(h[-keep:]), device=device))
            for h in query.histories])
        own = RetrievalQuery(query.users, query.histories, prefixes)
        return HeadRetrieval(self.model).propose(own, k)


def fused_scores(ranker: Tensor, stage: Tensor, stage_weight: float) -> Tensor:
    """A cascade's final score of ``[k]`` proposals: the ranker's scores plus ``stage_weight``
    times the stage's (float32, on the ranker's device); the ranker's own scores, untouched,
    when the weight is 0. The one formula of ``relaygr eval``'s cascade (``evaluate.fuse``) and
    ``relaygr serve``'s (``cascade.visit.Recommendation.final_scores``)."""
    if stage_weight == 0:
        return ranker
    assert ranker.shape == stage.shape, \
        f"one stage score per ranked item: {tuple(ranker.shape)} vs {tuple(stage.shape)}"
    return ranker.float() + stage_weight * stage.to(ranker.device).float()


RETRIEVAL_STAGES: dict[str, Callable[[HSTU], RetrievalStage]] = {"head": HeadRetrieval}


def retrieval_stage(name: str, model: HSTU) -> RetrievalStage:
    """The stage called ``name`` (``--retrieval``) for ``model``."""
    if name not in RETRIEVAL_STAGES:
        raise ConfigError(f"unknown retrieval stage {name!r}; choose one of "
                          f"{sorted(RETRIEVAL_STAGES)}")
    return RETRIEVAL_STAGES[name](model)
