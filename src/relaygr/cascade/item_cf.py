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

# Items whose co-occurrence rows are computed at once while the table is built (a sparse
# product: its size follows the pairs that share a user, not the catalogue squared).
_BLOCK_ROWS = 1024


@dataclass(frozen=True)
class ItemNeighbours:
    """``table[i]``: item ``i``'s most similar items and their cosine similarity, a CSR matrix
    over ``num_items + 1`` ids (row and column 0 empty)."""

    table: sp.csr_matrix

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
        norm = np.sqrt(np.diff(by_item.indptr).astype(np.float64))
        indptr, indices, data = [0], [], []
        for start in range(0, num_items + 1, _BLOCK_ROWS):
            shared = (by_item[start:start + _BLOCK_ROWS] @ bought).tocsr()  # co-buying users
            for r in range(shared.shape[0]):
                item = start + r
                lo, hi = shared.indptr[r], shared.indptr[r + 1]
                others, counts = shared.indices[lo:hi], shared.data[lo:hi]
                other = others != item                           # not its own neighbour
                others, counts = others[other], counts[other]
                # cosine, rounded to the float32 the table stores before it is ranked, so
                # that equal similarities tie exactly
                cosine = (counts / (norm[item] * norm[others])).astype(np.float32)
                keep = _top(others, cosine, neighbours)
                indices.append(others[keep])
                data.append(cosine[keep])
                indptr.append(indptr[-1] + len(keep))
        table = sp.csr_matrix((np.concatenate(data), np.concatenate(indices), indptr),
                              shape=(num_items + 1, num_items + 1))
        return cls(table)


def _top(ids: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Positions of the ``n`` largest positive ``values``, largest first, ties to the lower
    id."""
    where = np.flatnonzero(values > 0)
    if len(where) > n:   # the n-th value, then all above it and the lowest ids tied with it
        nth = np.partition(values[where], -n)[-n]
        above, tied = where[values[where] > nth], where[values[where] == nth]
        where = np.concatenate([above, tied[np.argsort(ids[tied], kind="stable")][:n - len(above)]])
    return where[np.lexsort((ids[where], -values[where]))]


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
        if k < 1:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        # sum the rows over the items they name only (not a vector over the catalogue)
        weight = np.repeat(self.recency ** np.arange(len(recent), dtype=np.float64),
                           np.diff(rows.indptr))
        found, slot = np.unique(rows.indices, return_inverse=True)
        score = np.bincount(slot, weights=weight * rows.data, minlength=len(found))
        if exclude is not None and len(exclude):
            keep = ~np.isin(found, np.asarray(exclude, dtype=np.int64))
            found, score = found[keep], score[keep]
        top = _top(found, score, k)
        ids = found[top]
        return ids, score[top].astype(np.float32)
