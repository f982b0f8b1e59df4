"""The dual-tower retrieval model: one encoder tower per domain over that domain's training graph.

``RetrievalModel`` is what serving uses (``relaygr.cascade.trained_retrieval``):

- ``item_vectors(domain)``: every item's vector of the domain, ``(num_items, vector_dim)``
  float32 (the FAISS index's rows; ``vector_dim`` is ``dim + 1`` with the popularity prior);
- ``user_vector(domain, item_ids, user=None)``: a user's vector from its recent items in the
  domain (GraphSAGE over the user's own neighbourhood; equal to the full-graph vector when the
  items are the user's training items and ``user`` its id);
- ``user_vectors(domain)``: every known user's vector (evaluation).

Scores are inner products (of unit vectors under cosine similarity). The full-graph pass is
cached until ``refresh()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from relaygr.errors import ConfigError, InvalidInputError, ItemOutOfRangeError
from relaygr.retrieval.config import Encoder, SCCDRConfig
from relaygr.retrieval.encoders import LightGCNTower, SAGETower, TowerOutput
from relaygr.retrieval.graph import BipartiteGraph


class DomainTower(nn.Module):
    """One domain's encoder with the adjacency of its training graph."""

    def __init__(self, graph: BipartiteGraph, cfg: SCCDRConfig) -> None:
        super().__init__()
        self.graph = graph
        self.encoder_kind = cfg.encoder
        if cfg.encoder is Encoder.SAGE:
            self.encoder: nn.Module = SAGETower(graph.num_users, graph.num_items, cfg.dim,
                                                cfg.num_layers, cfg.normalize)
        else:
            self.encoder = LightGCNTower(graph.num_users, graph.num_items, cfg.dim,
                                         cfg.num_layers, cfg.normalize)
        self.adj = self.adjacency_of(graph)
        self.neighbour_mean = graph.user_item_mean()
        self.temperature = cfg.temperature
        degree = np.bincount(graph.edges[:, 1], minlength=graph.num_items)
        self.log_degree = torch.from_numpy(np.log1p(degree).astype(np.float32))   # (I,)
        self.pop_weight = nn.Parameter(torch.ones(())) if cfg.popularity_prior else None

    def item_bias(self) -> torch.Tensor | None:
        """``(I,)`` logit offsets of the popularity prior (None without it)."""
        return None if self.pop_weight is None else self.pop_weight * self.log_degree

    # Served vectors: their inner product is ``temperature`` x the matching logit, the prior
    # riding in one extra column (``[u, 1]`` . ``[v, temperature * bias]``).
    def served_users(self, users: torch.Tensor) -> torch.Tensor:
        if self.pop_weight is None:
            return users
        return torch.cat([users, torch.ones(len(users), 1, dtype=users.dtype)], dim=1)

    def served_items(self, items: torch.Tensor) -> torch.Tensor:
        bias = self.item_bias()
        return items if bias is None else torch.cat([items, self.temperature * bias[:, None]],
                                                    dim=1)

    def adjacency_of(self, graph: BipartiteGraph) -> torch.Tensor:
        """The adjacency this tower's encoder propagates with (mean or symmetric)."""
        return (graph.mean_adjacency() if self.encoder_kind is Encoder.SAGE
                else graph.sym_adjacency())

    def forward(self, adj: torch.Tensor | None = None) -> TowerOutput:
        out: TowerOutput = self.encoder(self.adj if adj is None else adj)
        return out


class RetrievalModel(nn.Module):
    """Towers by domain name (the pair's target first)."""

    def __init__(self, graphs: dict[str, BipartiteGraph], cfg: SCCDRConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.domains = list(graphs)
        self.towers = nn.ModuleDict({name: DomainTower(g, cfg) for name, g in graphs.items()})
        if cfg.share_user_embedding and len(self.domains) == 2:
            first, second = (self.tower(d).encoder for d in self.domains)
            second.user_emb = first.user_emb    # one parameter: both towers train it
        self._cache: dict[str, TowerOutput] = {}

    def tower(self, domain: str) -> DomainTower:
        if domain not in self.towers:
            raise InvalidInputError(f"unknown domain {domain!r}; this model has {self.domains}")
        tower = self.towers[domain]
        assert isinstance(tower, DomainTower)
        return tower

    def refresh(self) -> None:
        """Forget cached full-graph passes (call after the weights change)."""
        self._cache.clear()

    @torch.no_grad()
    def encode(self, domain: str) -> TowerOutput:
        if domain not in self._cache:
            self._cache[domain] = self.tower(domain)()
        return self._cache[domain]

    @torch.no_grad()
    def item_vectors(self, domain: str) -> np.ndarray:
        """``(num_items, vector_dim)`` float32, C-contiguous."""
        out = self.encode(domain)
        items = self.tower(domain).served_items(out.items)
        return np.ascontiguousarray(items.numpy(), dtype=np.float32)

    @torch.no_grad()
    def user_vectors(self, domain: str) -> np.ndarray:
        """``(num_users, vector_dim)`` float32: every user's full-graph vector."""
        out = self.encode(domain)
        users = self.tower(domain).served_users(out.users)
        return np.ascontiguousarray(users.numpy(), dtype=np.float32)

    @torch.no_grad()
    def user_vector(self, domain: str, item_ids: Sequence[int],
                    user: int | None = None) -> np.ndarray:
        """``(dim,)`` float32 from the user's recent items (module doc). Needs GraphSAGE."""
        tower = self.tower(domain)
        if not isinstance(tower.encoder, SAGETower):
            raise ConfigError("user_vector needs the GraphSAGE encoder")
        items = torch.as_tensor(np.asarray(item_ids, dtype=np.int64))
        if items.ndim != 1 or len(items) == 0:
            raise InvalidInputError("item_ids must be a non-empty list of item ids")
        if items.min() < 0 or items.max() >= tower.graph.num_items:
            raise ItemOutOfRangeError(f"item ids must be in [0, {tower.graph.num_items})")
        if user is not None and not 0 <= user < tower.graph.num_users:
            raise InvalidInputError(f"user {user} is not in [0, {tower.graph.num_users})")
        out = self.encode(domain)
        vec = tower.encoder.user_from_items(items, out.item_states, user)
        return tower.served_users(vec[None])[0].numpy().astype(np.float32)
