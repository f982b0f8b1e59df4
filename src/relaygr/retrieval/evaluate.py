"""Ranking metrics for the three protocols (``relaygr.retrieval.splits``) over any scorer.

A scorer maps users and candidate items of one domain to scores (higher is better). A held-out
item's rank is the number of candidates scoring higher than it plus a uniformly random share of
those tied with it (seeded, so reports repeat): the rank a random tie-break would give, neither
crediting nor punishing a scorer that cannot tell items apart (popularity ties often).
HR@K: rank < K; NDCG@K: ``1 / log2(rank + 2)`` when rank < K. Full-corpus HIT@K ranks against
every item of the domain with the user's training and validation items masked out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol as TypingProtocol

import numpy as np
import scipy.sparse as sp

from relaygr.retrieval.graph import BipartiteGraph, SharedUsers

FULL_KS = (50, 100, 200)


class Scorer(TypingProtocol):
    def scores(self, domain: str, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """``users``: ``(n,)``; ``items``: ``(n, m)`` or ``(m,)`` shared → ``(n, m)``."""
        ...


@dataclass(frozen=True)
class VectorScorer:
    """Inner products of user and item vectors by domain (``(U, d)``, ``(I, d)`` float32)."""

    users: dict[str, np.ndarray]
    items: dict[str, np.ndarray]

    def scores(self, domain: str, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        u = self.users[domain][users]                       # (n, d)
        if items.ndim == 1:
            return u @ self.items[domain][items].T          # (n, m)
        return np.einsum("nd,nmd->nm", u, self.items[domain][items])


@dataclass(frozen=True)
class PopularityScorer:
    """Training-interaction count of each item, by domain."""

    counts: dict[str, np.ndarray]

    @classmethod
    def of(cls, train: dict[str, np.ndarray], num_items: dict[str, int]) -> PopularityScorer:
        return cls({d: np.bincount(e[:, 1], minlength=num_items[d]).astype(np.float32)
                    for d, e in train.items()})

    def scores(self, domain: str, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        c = self.counts[domain][items]
        return np.broadcast_to(c, (len(users), len(items))) if items.ndim == 1 else c


@dataclass(frozen=True)
class ItemCFScorer:
    """Item-based collaborative filtering over both domains' training rows, no training.

    A user's score for item ``i`` of domain ``d`` sums the cosine similarity (by shared users)
    of ``i`` to each of the user's training items, in ``d`` and, for a pair, in the partner
    domain, plus ``prior_weight * log(1 + deg(i))`` (what ranks items no item of the user
    co-occurs with). The partner's term is what makes it a cross-domain baseline: on a pair
    whose catalogues list some products in both domains, the user's partner-domain item points
    at the same product in this one."""

    rows: dict[str, sp.csr_matrix]                 # domain -> (U, I_d) the user's items
    similarity: dict[str, dict[str, sp.csr_matrix]]   # d -> source domain -> (I_src, I_d)
    prior: dict[str, np.ndarray]                   # d -> (I_d,) prior_weight * log(1 + deg)

    PRIOR_WEIGHT = 0.1   # chosen on sport_cloth validation (0.01 / 0.1 / 1.0), docs/retrieval.md

    @classmethod
    def of(cls, train: dict[str, np.ndarray], num_items: dict[str, int], num_users: int,
           prior_weight: float = PRIOR_WEIGHT) -> ItemCFScorer:
        graphs = {d: BipartiteGraph(num_users, num_items[d], e) for d, e in train.items()}
        rows = {d: g.interactions() for d, g in graphs.items()}
        similarity: dict[str, dict[str, sp.csr_matrix]] = {}
        for d in graphs:
            similarity[d] = {}
            for src in graphs:
                pairs = SharedUsers.of(graphs[d], graphs[src])
                # an item is not its own neighbour
                keep = pairs.partner_items != pairs.target_items if src == d else None
                similarity[d][src] = pairs.matrix(pairs.cosine, keep)
        prior = {d: (prior_weight * np.log1p(np.asarray(r.sum(axis=0)).ravel())
                     ).astype(np.float32) for d, r in rows.items()}
        return cls(rows, similarity, prior)

    def scores(self, domain: str, users: np.ndarray, items: np.ndarray,
               block: int = 512) -> np.ndarray:
        out = []
        for s in range(0, len(users), block):     # a block's dense (block, I_d) row at a time
            u = users[s:s + block]
            total = sum((self.rows[src][u] @ sim for src, sim in self.similarity[domain].items()),
                        sp.csr_matrix((len(u), len(self.prior[domain])), dtype=np.float32))
            dense = np.asarray(total.toarray(), dtype=np.float32) + self.prior[domain]
            out.append(dense[:, items] if items.ndim == 1
                       else np.take_along_axis(dense, items[s:s + block], axis=1))
        return np.concatenate(out) if out else np.zeros((0, items.shape[-1]), np.float32)


@dataclass(frozen=True)
class SumScorer:
    """``first + weight * second``: two retrieval channels fused by a weighted sum."""

    first: Scorer
    second: Scorer
    weight: float

    def scores(self, domain: str, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        a = self.first.scores(domain, users, items)
        if self.weight == 0:
            return a
        return a + self.weight * self.second.scores(domain, users, items)


TIE_SEED = 20250222   # fixed: the random tie-break is part of the protocol, not of a run


def tie_broken_rank(above: np.ndarray, tied: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``above`` + a uniform integer in ``[0, tied]`` per row."""
    return above + np.floor(rng.random(len(above)) * (tied + 1)).astype(np.int64)


def sampled_ranks(scorer: Scorer, domain: str, rows: np.ndarray, negatives: np.ndarray,
                  chunk: int = 4096) -> np.ndarray:
    """Rank of each row's item among ``[item] + negatives`` (module doc), ``(n,)`` int64."""
    rng = np.random.default_rng(TIE_SEED)
    ranks = np.empty(len(rows), dtype=np.int64)
    for s in range(0, len(rows), chunk):
        r = rows[s:s + chunk]
        cand = np.concatenate([r[:, 1:2], negatives[s:s + chunk]], axis=1)
        raw = np.asarray(scorer.scores(domain, r[:, 0], cand))
        sc = _no_nan(raw)
        above = (sc[:, 1:] > sc[:, :1]).sum(axis=1)
        ranks[s:s + chunk] = tie_broken_rank(above, (sc[:, 1:] == sc[:, :1]).sum(axis=1), rng)
        ranks[s:s + chunk][np.isnan(raw[:, 0])] = cand.shape[1]     # a NaN item: a miss
    return ranks


def _no_nan(scores: np.ndarray) -> np.ndarray:
    """``scores`` with NaN at -inf for the comparisons (a NaN compares False with anything,
    so a NaN item would read as ranked first); the caller marks a NaN item's row a miss."""
    return np.where(np.isnan(scores), -np.inf, scores) if np.isnan(scores).any() else scores


def full_ranks(scorer: Scorer, domain: str, rows: np.ndarray, num_items: int,
               known: np.ndarray, chunk: int = 512) -> np.ndarray:
    """Rank of each row's item among all items, ``known`` (user, item) pairs masked."""
    order = np.argsort(known[:, 0], kind="stable")
    ends = np.cumsum(np.bincount(known[:, 0], minlength=int(rows[:, 0].max()) + 1))
    starts = ends - np.bincount(known[:, 0], minlength=len(ends))
    all_items = np.arange(num_items)
    rng = np.random.default_rng(TIE_SEED)
    ranks = np.empty(len(rows), dtype=np.int64)
    for s in range(0, len(rows), chunk):
        r = rows[s:s + chunk]
        sc = np.array(scorer.scores(domain, r[:, 0], all_items), dtype=np.float32)
        for i, u in enumerate(r[:, 0]):
            masked = known[order[starts[u]:ends[u]], 1] if u < len(ends) else []
            sc[i, masked] = -np.inf
        pos = sc[np.arange(len(r)), r[:, 1]]
        sc[np.arange(len(r)), r[:, 1]] = -np.inf
        nan_item = np.isnan(pos)
        sc = _no_nan(sc)
        above = (sc > pos[:, None]).sum(axis=1)
        ranks[s:s + chunk] = tie_broken_rank(above, (sc == pos[:, None]).sum(axis=1), rng)
        ranks[s:s + chunk][nan_item] = num_items                     # a NaN item: a miss
    return ranks


def hr_ndcg(ranks: np.ndarray, k: int = 10) -> dict[str, float]:
    hit = ranks < k
    ndcg = np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0)
    return {f"hr@{k}": float(hit.mean()), f"ndcg@{k}": float(ndcg.mean())}


def hits(ranks: np.ndarray, ks: tuple[int, ...] = FULL_KS) -> dict[str, float]:
    return {f"hit@{k}": float((ranks < k).mean()) for k in ks}
