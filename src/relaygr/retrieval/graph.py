"""A domain's user-item bipartite graph and the normalised adjacencies the encoders use.

Nodes are numbered users first (``0..num_users-1``), then items (``num_users + item``). The
graph is undirected: every interaction is an edge both ways. ``mean_adjacency`` is ``D^-1 A``
(GraphSAGE's mean aggregator: each row averages the node's neighbours; an isolated node's row is
empty), ``sym_adjacency`` is ``D^-1/2 A D^-1/2`` (LightGCN). Both come as torch sparse COO
tensors of shape ``(num_nodes, num_nodes)``, float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch


@dataclass(frozen=True)
class BipartiteGraph:
    """The interactions ``edges`` (``(n, 2)`` user, item) of one domain."""

    num_users: int
    num_items: int
    edges: np.ndarray

    def __post_init__(self) -> None:
        assert self.edges.ndim == 2 and self.edges.shape[1] == 2, "edges are (n, 2)"
        if len(self.edges):
            assert self.edges[:, 0].max() < self.num_users, "user id out of range"
            assert self.edges[:, 1].max() < self.num_items, "item id out of range"

    @property
    def num_nodes(self) -> int:
        return self.num_users + self.num_items

    def interactions(self) -> sp.csr_matrix:
        """``R``: ``(num_users, num_items)`` 0/1 (duplicate edges count once)."""
        r = sp.csr_matrix((np.ones(len(self.edges), np.float32),
                           (self.edges[:, 0], self.edges[:, 1])),
                          shape=(self.num_users, self.num_items))
        r.data[:] = 1.0
        return r

    def item_degree(self) -> np.ndarray:
        """``(num_items,)``: each item's number of users (its degree in ``adjacency``)."""
        return np.asarray(self.interactions().sum(axis=0)).ravel()

    def adjacency(self) -> sp.csr_matrix:
        """``A = [[0, R], [R^T, 0]]`` over all nodes."""
        r = self.interactions()
        a: sp.csr_matrix = sp.bmat([[None, r], [r.T, None]], format="csr", dtype=np.float32)
        return a

    def mean_adjacency(self) -> torch.Tensor:
        a = self.adjacency()
        deg = np.asarray(a.sum(axis=1)).ravel()
        inv = np.divide(1.0, deg, out=np.zeros_like(deg), where=deg > 0)
        return to_torch(sp.diags(inv) @ a)

    def sym_adjacency(self) -> torch.Tensor:
        a = self.adjacency()
        deg = np.asarray(a.sum(axis=1)).ravel()
        inv = np.divide(1.0, np.sqrt(deg), out=np.zeros_like(deg), where=deg > 0)
        d = sp.diags(inv)
        return to_torch(d @ a @ d)

    def user_item_mean(self) -> torch.Tensor:
        """``(num_users, num_items)``: each user's row averages its items (neighbour means)."""
        r = self.interactions()
        deg = np.asarray(r.sum(axis=1)).ravel()
        inv = np.divide(1.0, deg, out=np.zeros_like(deg), where=deg > 0)
        return to_torch(sp.diags(inv) @ r)

    def with_partner(self, partner: BipartiteGraph) -> BipartiteGraph:
        """This graph with ``partner``'s items appended as items ``num_items..`` (same users)."""
        assert partner.num_users == self.num_users, "a partner graph shares the users"
        shifted = partner.edges + np.array([0, self.num_items], dtype=partner.edges.dtype)
        return BipartiteGraph(self.num_users, self.num_items + partner.num_items,
                              np.concatenate([self.edges, shifted]))

    def with_edges(self, edges: np.ndarray) -> BipartiteGraph:
        """This graph with ``edges`` (``(n, 2)`` user, item) added, duplicates kept once."""
        merged = np.unique(np.concatenate([self.edges, edges.astype(self.edges.dtype)]), axis=0)
        return BipartiteGraph(self.num_users, self.num_items, merged)

    def drop_edges(self, rate: float, rng: np.random.Generator) -> BipartiteGraph:
        """A view keeping each edge with probability ``1 - rate`` (edge dropout)."""
        keep = rng.random(len(self.edges)) >= rate
        return BipartiteGraph(self.num_users, self.num_items, self.edges[keep])

    def items_of(self) -> list[np.ndarray]:
        """Each user's items, sorted (index = user id)."""
        r = self.interactions()
        return [r.indices[r.indptr[u]:r.indptr[u + 1]].copy() for u in range(self.num_users)]


def to_torch(m: sp.spmatrix) -> torch.Tensor:
    """A scipy matrix as a coalesced float32 torch sparse COO tensor."""
    coo = sp.coo_matrix(m)
    idx = torch.from_numpy(np.vstack([coo.row, coo.col]).astype(np.int64))
    val = torch.from_numpy(coo.data.astype(np.float32))
    return torch.sparse_coo_tensor(idx, val, coo.shape, check_invariants=False).coalesce()


@dataclass(frozen=True)
class SharedUsers:
    """Pairs (partner item, target item) with at least one training user in common: how many
    (``shared``), the Jaccard index and the cosine similarity (``shared / sqrt(deg deg)``) of
    their user sets. ``shape`` is ``(partner items, target items)``."""

    partner_items: np.ndarray
    target_items: np.ndarray
    shared: np.ndarray
    jaccard: np.ndarray
    cosine: np.ndarray
    shape: tuple[int, int]

    @classmethod
    def of(cls, target: BipartiteGraph, partner: BipartiteGraph) -> SharedUsers:
        r_t, r_p = target.interactions(), partner.interactions()
        deg_t = np.asarray(r_t.sum(axis=0)).ravel()
        deg_p = np.asarray(r_p.sum(axis=0)).ravel()
        co = (r_p.T @ r_t).tocoo()                      # (I_p, I_t) users in common
        d_p, d_t = deg_p[co.row], deg_t[co.col]
        return cls(co.row.astype(np.int64), co.col.astype(np.int64), co.data,
                   co.data / (d_p + d_t - co.data), co.data / np.sqrt(d_p * d_t),
                   (partner.num_items, target.num_items))

    def matrix(self, values: np.ndarray, keep: np.ndarray | None = None) -> sp.csr_matrix:
        """``values`` (one per pair, e.g. ``cosine``) as a ``shape`` float32 matrix, only the
        pairs ``keep`` marks when given."""
        rows, cols = self.partner_items, self.target_items
        if keep is not None:
            rows, cols, values = rows[keep], cols[keep], values[keep]
        return sp.csr_matrix((values.astype(np.float32), (rows, cols)), shape=self.shape)


def bridge_links(target: BipartiteGraph, partner: BipartiteGraph, min_jaccard: float,
                 min_shared: int = 2) -> np.ndarray:
    """``(partner.num_items,)`` int64: for each partner item, the target item bought by the most
    nearly the same users (the highest Jaccard of their user sets, >= ``min_jaccard``, with at
    least ``min_shared`` users in common; among equals the lowest id), or -1 where none
    qualifies. The same product listed in both catalogues under two ids shows up this way."""
    pairs = SharedUsers.of(target, partner)
    keep = (pairs.shared >= min_shared) & (pairs.jaccard >= min_jaccard)
    rows, cols, score = pairs.partner_items[keep], pairs.target_items[keep], pairs.jaccard[keep]
    order = np.lexsort((cols, -score, rows))             # by partner item, best first
    first = np.unique(rows[order], return_index=True)[1]
    links = np.full(partner.num_items, -1, dtype=np.int64)
    links[rows[order][first]] = cols[order][first]
    return links


def bridged_edges(partner: BipartiteGraph, links: np.ndarray,
                  held_out: np.ndarray | None = None) -> np.ndarray:
    """``(n, 2)`` (user, target item): each partner interaction whose item has a link, except
    the pairs of ``held_out`` (``(m, 2)``: the target domain's validation and test rows).

    A cross-listed product is one purchase recorded in both catalogues, and each domain's
    evaluation holds out its own rows: a held-out (user, item) often has its twin among the
    partner's training rows, and bridged, it would be an edge of the very graph the user's
    vector aggregates, the answer inside the question (on sport_cloth ~11 % of the test rows)."""
    target = links[partner.edges[:, 1]]
    edges = np.stack([partner.edges[:, 0], target], axis=1)[target >= 0]
    if held_out is not None and len(held_out) and len(edges):
        edges = edges[~np.isin(pair_keys(edges), pair_keys(held_out))]
    return np.unique(edges, axis=0) if len(edges) else edges.reshape(0, 2)


def pair_keys(pairs: np.ndarray) -> np.ndarray:
    """One int64 per ``(n, 2)`` (user, item) row, equal exactly when the rows are (for set
    operations on rows)."""
    return pairs[:, 0].astype(np.int64) * (1 << 32) + pairs[:, 1].astype(np.int64)
