"""Item-to-item collaborative filtering as a retrieval channel (``ItemCFRetrieval``).

The table (``ItemNeighbours``), built from training interactions: the cosine similarity of two
items over the users who interacted with both, ``|U_i & U_j| / sqrt(|U_i| |U_j|)``, each item
keeping only its ``neighbours`` most similar others (the table a production item-to-item
channel precomputes; keeping a short list also drops the long tail of pairs that share one or
two users by chance, which on ML-1M finds more targets than the whole matrix:
docs/retrieval.md, "Item-CF as a third channel").

At request time the user's latest ``recent_events`` events, the k-th newest weighing
``recency ** k`` as in the other channels, each add their row of the table; the items with a
positive sum are ranked by it. So the channel proposes only items that co-occur with something
the user did, and fewer than ``k`` where few do (``InterleavedRetrieval`` gives the rest of the
list to the other channels). A user none of whose events has a neighbour in the table gets
``EmptyInputError``, as a tower that knows none of them would.

Ids are the ranker's (dense, 1-based, 0 unused), as every strategy's
(``cascade.proposals``); ``ItemNeighbours.of_rows`` takes rows already in those ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from relaygr.errors import ConfigError, EmptyInputError

# Items whose co-occurrence rows are computed at once while the table is built: a dense block of
# this many rows by the catalogue (4 MB for ML-1M's 3,706 items).
_BLOCK_ROWS = 256


@dataclass(frozen=True)
class ItemNeighbours:
    """``table[i]``: item ``i``'s most similar items and their cosine similarity, a CSR matrix
    over ``num_items + 1`` ids (row and column 0 empty)."""

    table: sp.csr_matrix
    neighbours: int

    @classmethod
    def of_rows(cls, users: np.ndarray, items: np.ndarray, num_items: int,
                neighbours: int) -> ItemNeighbours:
        """The table of the interactions ``(users[r], items[r])`` (items ``1 .. num_items``; a
        repeated pair counts once), each item keeping its ``neighbours`` most similar others
        (ties: the lower id)."""
        if neighbours < 1:
            raise ConfigError(f"item-CF needs neighbours >= 1, got {neighbours}")
        users = np.asarray(users, dtype=np.int64)
        items = np.asarray(items, dtype=np.int64)
        if users.shape != items.shape or (items.size and not
                                          (items.min() >= 1 and items.max() <= num_items)):
            raise ConfigError(f"item-CF rows must pair users with items 1 .. {num_items}")
        _, user_rows = np.unique(users, return_inverse=True)
        bought = sp.csr_matrix((np.ones(len(items)), (user_rows, items)),
                               shape=(int(user_rows.max(initial=-1)) + 1, num_items + 1))
        bought.data[:] = 1.0                     # duplicates were summed: once is once
        by_item = bought.T.tocsr()               # (items, users)
        degree = np.asarray(by_item.sum(axis=1)).ravel()
        norm = np.sqrt(degree)
        indptr, indices, data = [0], [], []
        for start in range(0, num_items + 1, _BLOCK_ROWS):
            rows = slice(start, min(start + _BLOCK_ROWS, num_items + 1))
            shared = (by_item[rows] @ bought).toarray()              # co-buying users
            cosine = shared / np.maximum(np.outer(norm[rows], norm), 1e-12)
            for r, row in enumerate(cosine, start):
                row[r] = 0.0                                         # not its own neighbour
                keep = _top(row, neighbours)
                indices.append(keep)
                data.append(row[keep].astype(np.float32))
                indptr.append(indptr[-1] + len(keep))
        table = sp.csr_matrix((np.concatenate(data), np.concatenate(indices), indptr),
                              shape=(num_items + 1, num_items + 1))
        return cls(table, neighbours)


def _top(row: np.ndarray, n: int) -> np.ndarray:
    """Ids of the ``n`` largest positive entries of ``row``, largest first, ties to the lower
    id."""
    positive = np.flatnonzero(row > 0)
    order = np.lexsort((positive, -row[positive]))
    return positive[order[:n]]


class ItemCFRetrieval:
    """``ItemNeighbours`` behind ``RetrievalStage`` (see the module docstring)."""

    def __init__(self, neighbours: ItemNeighbours, recent_events: int, *, recency: float,
                 name: str = "item-cf") -> None:
        if recent_events < 1 or not 0 < recency <= 1:
            raise ConfigError(f"ItemCFRetrieval needs recent_events >= 1 and recency in "
                              f"(0, 1], got {recent_events} and {recency}")
        self.neighbours, self.name = neighbours, name
        self.recent_events, self.recency = recent_events, recency

    @property
    def num_items(self) -> int:
        return self.neighbours.table.shape[0] - 1

    def propose(self, history: np.ndarray, k: int, user_id: int | None = None) -> np.ndarray:
        return self.scored(history, k, user_id)[0]

    def scored(self, history: np.ndarray, k: int, user_id: int | None = None,
               exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``k`` ids with a positive summed similarity, best first (ties: the lower id),
        none of ``exclude`` among them; their sums as scores."""
        events = np.asarray(history, dtype=np.int64)
        if events.size == 0:
            raise EmptyInputError("retrieval needs at least one event in the user's history")
        if events.min() < 1 or events.max() > self.num_items:
            raise ConfigError(f"item ids must be in 1 .. {self.num_items}")
        recent = events[::-1][:self.recent_events]                  # newest first
        rows = self.neighbours.table[recent]
        if not rows.nnz:
            raise EmptyInputError(f"none of the user's {len(recent)} latest events has an "
                                  "item-CF neighbour")
        weights = self.recency ** np.arange(len(recent), dtype=np.float64)
        score = np.asarray(rows.T @ weights, dtype=np.float64).ravel()
        if exclude is not None and len(exclude):
            score[np.asarray(exclude, dtype=np.int64)] = 0.0
        positive = np.flatnonzero(score > 0)                         # ascending ids
        if positive.size > k:
            kth = np.partition(score[positive], -k)[-k]
            tied = positive[score[positive] == kth]
            positive = np.concatenate([positive[score[positive] > kth],
                                       tied[:k - int((score[positive] > kth).sum())]])
        ids = positive[np.lexsort((positive, -score[positive]))]
        return ids, score[ids].astype(np.float32)
