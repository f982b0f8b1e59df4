"""Inter-domain curriculum: negatives anchored by overlapping users, ordered by a Katz measure and
introduced easy to hard.

Difficulty of negative ``v`` for anchor ``u`` is their truncated Katz proximity on the joint
user-item graph of both domains (``R = [R_target | R_source]``, users shared). Between two users
only even-length paths exist, so with ``B = R R^T``::

    S = sum_{k=1..hops} beta^(2k) B^k

A user close to the anchor in the graph is hard to tell apart from it. Each anchor keeps a pool
of ``pool_size`` other users taken at evenly spaced ranks of its sorted scores (easiest first,
ties broken by a seeded random key), so the pool spans the anchor's whole difficulty range and
its last entry is the anchor's most similar user. At training progress ``t`` the pacing function
gives the share of the pool (from the easy end) that negatives are drawn from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from relaygr.retrieval.config import Pacing


def katz_user_scores(r: sp.csr_matrix, users: np.ndarray, beta: float, hops: int) -> np.ndarray:
    """Rows ``users`` of ``S`` (the module doc): ``(len(users), num_users)`` float64."""
    rt = r.T.tocsr()
    walk = (r[users] @ rt).toarray().astype(np.float64)   # B rows: (n, U)
    total = beta ** 2 * walk
    for k in range(2, hops + 1):
        walk = np.asarray((walk @ r) @ rt)               # B^k rows
        total += beta ** (2 * k) * walk
    return total


def difficulty_pools(r: sp.csr_matrix, beta: float, hops: int, pool_size: int,
                     rng: np.random.Generator, chunk: int = 256) -> np.ndarray:
    """``(U, pool_size)`` user ids per anchor, easiest first (the module doc)."""
    num_users = r.shape[0]
    assert num_users > pool_size, "need more users than the pool holds"
    rank_at = np.round(np.linspace(0, num_users - 2, pool_size)).astype(np.int64)
    pools = np.empty((num_users, pool_size), dtype=np.int64)
    for start in range(0, num_users, chunk):
        users = np.arange(start, min(start + chunk, num_users))
        scores = katz_user_scores(r, users, beta, hops)
        scores[np.arange(len(users)), users] = np.inf          # the anchor itself: never
        tie = rng.random(scores.shape)
        order = np.lexsort((tie, scores), axis=1)               # ascending score, random ties
        pools[users] = order[:, rank_at]
    return pools


def pacing_share(pacing: Pacing, progress: float, start_share: float) -> float:
    """Share of the pool available at ``progress`` in [0, 1] (1.0 once progress reaches 1)."""
    t = min(max(progress, 0.0), 1.0)
    if pacing is Pacing.LINEAR:
        return start_share + (1.0 - start_share) * t
    if pacing is Pacing.ROOT:
        return math.sqrt(start_share ** 2 + (1.0 - start_share ** 2) * t)
    if pacing is Pacing.STEP:
        return start_share + (1.0 - start_share) * min(math.floor(t * 3) / 2, 1.0)
    return 1.0


@dataclass(frozen=True)
class NegativeSampler:
    """Draws inter-CL negatives for a batch of anchor users (curriculum or uniform)."""

    num_users: int
    pacing: Pacing
    pools: np.ndarray | None       # (U, P), required unless pacing is NONE
    start_share: float
    curriculum_epochs: int

    def available(self, epoch: int) -> int:
        """How many of an anchor's pool entries (from the easy end) ``epoch`` draws from."""
        assert self.pools is not None
        share = pacing_share(self.pacing, epoch / self.curriculum_epochs, self.start_share)
        return max(1, math.ceil(share * self.pools.shape[1]))

    def sample(self, anchors: torch.Tensor, k: int, epoch: int,
               gen: torch.Generator) -> torch.Tensor:
        """``(len(anchors), k)`` negative user ids; never the anchor itself."""
        if self.pacing is Pacing.NONE or self.pools is None:
            draw = torch.randint(0, self.num_users - 1, (len(anchors), k), generator=gen)
            return draw + (draw >= anchors[:, None]).long()     # skip the anchor's own id
        cols = torch.randint(0, self.available(epoch), (len(anchors), k), generator=gen)
        return torch.from_numpy(self.pools)[anchors[:, None], cols]
