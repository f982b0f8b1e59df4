"""Retrieval: top-K items for a user by inner product with the model's item embeddings (FAISS).

The index holds ``HSTU.item_embeddings()`` (row i is item id i + 1) and is searched with user
representations (``PrefixKV.last_hidden`` or a prefill's output), which is the model's own
retrieval score (``HSTU.retrieval_scores``). Returned ids are dense, 1-based item ids. The
index is a snapshot: ``refresh(model)`` rebuilds it when the model's embeddings changed.
Retrieval runs on the host (it is a separate fleet in the cascade): CUDA inputs are copied to
host memory. Not thread-safe while rebuilding; searches may run concurrently with each other.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import torch
from torch import Tensor

from relaygr.errors import ConfigError, InvalidInputError
from relaygr.model import HSTU
from relaygr.settings import load


class IndexKind(enum.Enum):
    FLAT = "flat"   # exact inner-product search
    IVF = "ivf"     # inverted lists: approximate, for large catalogues


@dataclass(frozen=True)
class RetrievalConfig:
    """Index settings; the IVF ones apply only to ``IndexKind.IVF``."""

    kind: IndexKind = IndexKind.FLAT
    # ~sqrt(catalogue) lists is FAISS's usual starting point for a million-item catalogue.
    ivf_lists: int = 1024
    # Lists probed per query: recall vs speed; 1/32 of the lists keeps recall high.
    ivf_probes: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.kind, IndexKind):
            raise ConfigError(f"RetrievalConfig.kind must be an IndexKind, got {self.kind!r}")
        if self.ivf_lists < 1 or self.ivf_probes < 1:
            raise ConfigError("RetrievalConfig needs ivf_lists >= 1 and ivf_probes >= 1")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RetrievalConfig:
        """From plain settings (``kind`` by name: ``"flat"`` or ``"ivf"``)."""
        return load(cls, data)


@dataclass(frozen=True)
class RetrievalResult:
    """``item_ids`` ``[B, k]`` int64 (1-based) and ``scores`` ``[B, k]`` float32, best first.

    An IVF index may find fewer than ``k`` items for a row when its probed lists hold too few;
    those trailing slots hold id 0 (the padding id, never a real item) and score -inf
    (``valid`` is False there). A flat index always fills every slot."""

    item_ids: np.ndarray
    scores: np.ndarray

    @property
    def valid(self) -> np.ndarray:
        return self.item_ids > 0


def _host_float32(name: str, values: Tensor | np.ndarray, dim: int | None = None) -> np.ndarray:
    if isinstance(values, Tensor):
        values = values.detach().to("cpu", torch.float32).numpy()
    array = np.ascontiguousarray(values, dtype=np.float32)
    if array.ndim != 2 or (dim is not None and array.shape[1] != dim):
        want = "[N, d]" if dim is None else f"[B, {dim}]"
        raise InvalidInputError(f"{name} must be {want}, got shape {array.shape}")
    return array


class Retriever:
    """Inner-product top-K over an item-embedding table."""

    def __init__(self, item_embeddings: Tensor | np.ndarray,
                 config: RetrievalConfig | None = None) -> None:
        self.config = config or RetrievalConfig()
        self._fingerprint: tuple[int, int, tuple[int, ...]] | None = None
        self.rebuild(item_embeddings)

    @classmethod
    def from_model(cls, model: HSTU, config: RetrievalConfig | None = None) -> Retriever:
        retriever = cls(model.item_embeddings(), config)
        retriever._fingerprint = _fingerprint(model)
        return retriever

    def rebuild(self, item_embeddings: Tensor | np.ndarray) -> None:
        """Replace the index with one over ``item_embeddings`` (``[num_items, d]``)."""
        table = _host_float32("item_embeddings", item_embeddings)
        num_items, dim = table.shape
        if num_items == 0:
            raise InvalidInputError("item_embeddings is empty")
        index: faiss.Index
        if self.config.kind is IndexKind.FLAT:
            index = faiss.IndexFlatIP(dim)
        else:
            if self.config.ivf_lists > num_items:
                raise ConfigError(f"ivf_lists ({self.config.ivf_lists}) exceeds the catalogue "
                                  f"({num_items} items)")
            quantizer = faiss.IndexFlatIP(dim)
            index = faiss.IndexIVFFlat(quantizer, dim, self.config.ivf_lists,
                                       faiss.METRIC_INNER_PRODUCT)
            index.train(table)
            index.nprobe = min(self.config.ivf_probes, self.config.ivf_lists)
            self._quantizer = quantizer   # the IVF index does not own it: keep it alive
        index.add(table)
        self._index, self.num_items, self.dim = index, num_items, dim
        self._fingerprint = None

    def is_current(self, model: HSTU) -> bool:
        """Whether the index was built from ``model``'s embeddings as they are now."""
        return self._fingerprint == _fingerprint(model)

    def refresh(self, model: HSTU) -> bool:
        """Rebuild from ``model`` if its embeddings changed since the build; True if rebuilt."""
        if self.is_current(model):
            return False
        self.rebuild(model.item_embeddings())
        self._fingerprint = _fingerprint(model)
        return True

    def search(self, user_vecs: Tensor | np.ndarray, k: int,
               exclude: Sequence[Sequence[int] | np.ndarray] | None = None) -> RetrievalResult:
        """Top-``k`` items per row of ``user_vecs`` (``[B, d]``), skipping ``exclude[b]``
        (e.g. the user's history) for row b. ``k`` must leave room: ``k <= num_items -
        len(set(exclude[b]))`` for every row."""
        queries = _host_float32("user_vecs", user_vecs, self.dim)
        excluded = self._excluded_sets(exclude, queries.shape[0])
        most_excluded = max((len(e) for e in excluded), default=0)
        if not isinstance(k, int) or isinstance(k, bool) or not \
                1 <= k <= self.num_items - most_excluded:
            raise InvalidInputError(f"k must be an int in [1, {self.num_items - most_excluded}] "
                                    f"(catalogue {self.num_items}, up to {most_excluded} "
                                    f"excluded), got {k!r}")
        scores, rows = self._index.search(queries, k + most_excluded)
        out_ids = np.zeros((queries.shape[0], k), dtype=np.int64)
        out_scores = np.full((queries.shape[0], k), -np.inf, dtype=np.float32)
        for b in range(queries.shape[0]):
            ids = rows[b] + 1                                  # row i holds item id i + 1
            keep = (rows[b] >= 0) & ~np.isin(ids, list(excluded[b]))
            ids, row_scores = ids[keep][:k], scores[b][keep][:k]
            out_ids[b, : ids.shape[0]] = ids
            out_scores[b, : ids.shape[0]] = row_scores
        return RetrievalResult(out_ids, out_scores)

    def _excluded_sets(self, exclude: Sequence[Sequence[int] | np.ndarray] | None,
                       batch: int) -> list[set[int]]:
        if exclude is None:
            return [set() for _ in range(batch)]
        if len(exclude) != batch:
            raise InvalidInputError(f"exclude has {len(exclude)} rows for {batch} queries")
        sets = []
        for row in exclude:
            ids = np.asarray(row, dtype=np.int64).reshape(-1)
            if ids.size and (ids.min() < 1 or ids.max() > self.num_items):
                raise InvalidInputError(f"exclude holds ids outside 1..{self.num_items}")
            sets.append({int(i) for i in ids})
        return sets


def _fingerprint(model: HSTU) -> tuple[int, int, tuple[int, ...]]:
    """Identity of the embedding table's current contents: storage, in-place version, shape."""
    table = model.item_embeddings()
    return (table.data_ptr(), table._version, tuple(table.shape))
