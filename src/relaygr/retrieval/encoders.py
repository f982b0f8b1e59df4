"""The per-domain towers: GraphSAGE and LightGCN, in plain PyTorch.

A tower owns its domain's user and item ID embeddings (layer 0) and maps a normalised adjacency
(``relaygr.retrieval.graph``) to user and item vectors (L2-normalised when ``normalize``:
cosine scoring; raw for dot-product scoring, where an item's norm can carry its popularity).
GraphSAGE layer ``l``::

    h_v^(l+1) = W_l [h_v^(l) || sum_{u in N(v)} a_vu h_u^(l)]      (LeakyReLU between layers)

with ``a_vu = 1 / deg(v)`` (``Aggregation.MEAN``: the mean adjacency ``D^-1 A``) or
``1 / sqrt(deg(v) deg(u))`` (``Aggregation.SYM``: ``D^-1/2 A D^-1/2``). Either way a user's
vector depends only on its own embedding, its items' layer states and (sym) their training
degrees: that is what ``SAGETower.user_from_items`` recomputes at request time from a list of
recent items, the user's degree being the list's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from relaygr.retrieval.config import Aggregation


@dataclass(frozen=True)
class TowerOutput:
    """Final vectors (``users``: ``(U, d)``, ``items``: ``(I, d)``) and, for
    GraphSAGE, every layer's item states before the last (``item_states[l]``: ``(I, d)``)."""

    users: torch.Tensor
    items: torch.Tensor
    item_states: tuple[torch.Tensor, ...] = ()


class SAGETower(nn.Module):
    """GraphSAGE over one domain's bipartite graph (full-graph sparse matmul).

    ``forward`` takes the adjacency of ``aggregation`` (mean or symmetric). Under
    ``Aggregation.SYM`` the request-time user side needs each item's degree in the graph the
    full-graph pass propagated over, ``item_degree`` (``(num_items,)``); an item of degree 0
    there (never trained) counts as degree 1, as if the requesting user were its one edge."""

    def __init__(self, num_users: int, num_items: int, dim: int, num_layers: int,
                 normalize: bool = True, aggregation: Aggregation = Aggregation.MEAN,
                 item_degree: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_users, self.num_items, self.normalize = num_users, num_items, normalize
        self.aggregation = aggregation
        # sym: 1 / sqrt(deg(i)) per item (not a parameter, not saved: the graph gives it)
        self.item_scale: torch.Tensor | None = None
        if aggregation is Aggregation.SYM:
            assert item_degree is not None and item_degree.shape == (num_items,), \
                "the symmetric aggregator needs every item's degree"
            self.item_scale = item_degree.to(torch.float32).clamp(min=1.0).rsqrt()
        self.user_emb = nn.Embedding(num_users, dim)
        self.item_emb = nn.Embedding(num_items, dim)
        nn.init.normal_(self.user_emb.weight, std=0.1)
        nn.init.normal_(self.item_emb.weight, std=0.1)
        self.layers = nn.ModuleList(nn.Linear(2 * dim, dim) for _ in range(num_layers))

    def _step(self, layer: int, h: torch.Tensor, agg: torch.Tensor) -> torch.Tensor:
        out = self.layers[layer](torch.cat([h, agg], dim=-1))   # (n, 2d) -> (n, d)
        return out if layer == len(self.layers) - 1 else F.leaky_relu(out, 0.2)

    def forward(self, adj: torch.Tensor) -> TowerOutput:
        """``adj``: ``(U + I, U + I)``, the graph's adjacency normalised as ``aggregation``
        says (``graph.mean_adjacency`` or ``graph.sym_adjacency``)."""
        h = torch.cat([self.user_emb.weight, self.item_emb.weight])   # (U + I, d)
        states = []
        for layer in range(len(self.layers)):
            states.append(h[self.num_users:])
            h = self._step(layer, h, torch.sparse.mm(adj, h))
        h = F.normalize(h, dim=-1) if self.normalize else h
        return TowerOutput(h[:self.num_users], h[self.num_users:], tuple(states))

    def user_from_items(self, items: torch.Tensor, item_states: tuple[torch.Tensor, ...],
                        user: int | None, weights: torch.Tensor | None = None) -> torch.Tensor:
        """A user's unit vector from its item ids (``(n,)``, n >= 1) and the item layer states of
        a full-graph pass; ``user`` None means an unseen user (zero layer-0 embedding).
        ``weights`` (``(n,)``, positive): a weighted mean over the items instead of the plain
        mean the graph's aggregation takes (equal weights give the plain mean up to rounding);
        under ``Aggregation.SYM`` item ``i``'s weight share ``s_i`` becomes
        ``s_i sqrt(n / deg(i))``, which equal shares turn into the graph's
        ``1 / sqrt(n deg(i))``."""
        dim = self.user_emb.embedding_dim
        h = (self.user_emb.weight[user] if user is not None
             else torch.zeros(dim, dtype=self.user_emb.weight.dtype))
        share = None if weights is None else (weights / weights.sum()).to(h.dtype)
        return self._from_items(h, items, share, item_states)

    def users_from_item_lists(self, users: torch.Tensor, items: torch.Tensor,
                              share: torch.Tensor, item_states: tuple[torch.Tensor, ...]
                              ) -> torch.Tensor:
        """``user_from_items`` for a batch of trained users: ``users`` ``(B,)``, ``items``
        ``(B, L)`` and their weights ``share`` ``(B, L)`` (each row summing to 1, 0 on
        padding); ``(B, d)``."""
        return self._from_items(self.user_emb.weight[users], items, share, item_states)

    def _from_items(self, h: torch.Tensor, items: torch.Tensor, share: torch.Tensor | None,
                    item_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The user side of every layer from layer-0 states ``h`` (``(..., d)``) and items
        ``(..., L)``, their mean weighted by ``share`` (``(..., L)``; None: the plain mean),
        each item's share rescaled by its degree under ``Aggregation.SYM``."""
        if self.item_scale is not None:
            if share is None:
                share = torch.full(items.shape, 1.0 / items.shape[-1], dtype=h.dtype)
            n = (share > 0).sum(-1, keepdim=True).to(h.dtype)          # the user's degree
            share = share * n.sqrt() * self.item_scale[items].to(h.dtype)   # (..., L)
        for layer, states in enumerate(item_states):
            rows = states[items]                                       # (..., L, d)
            agg = rows.mean(-2) if share is None else (share[..., None] * rows).sum(-2)
            h = self._step(layer, h, agg)
        return F.normalize(h, dim=-1) if self.normalize else h


class LightGCNTower(nn.Module):
    """LightGCN: propagate ID embeddings with ``D^-1/2 A D^-1/2``, average the layers."""

    def __init__(self, num_users: int, num_items: int, dim: int, num_layers: int,
                 normalize: bool = True) -> None:
        super().__init__()
        self.num_users, self.num_items, self.num_layers = num_users, num_items, num_layers
        self.normalize = normalize
        self.user_emb = nn.Embedding(num_users, dim)
        self.item_emb = nn.Embedding(num_items, dim)
        nn.init.normal_(self.user_emb.weight, std=0.1)
        nn.init.normal_(self.item_emb.weight, std=0.1)

    def forward(self, sym_adj: torch.Tensor) -> TowerOutput:
        h = torch.cat([self.user_emb.weight, self.item_emb.weight])
        total = h
        for _ in range(self.num_layers):
            h = torch.sparse.mm(sym_adj, h)
            total = total + h
        out = total / (self.num_layers + 1)
        out = F.normalize(out, dim=-1) if self.normalize else out
        return TowerOutput(out[:self.num_users], out[self.num_users:])
