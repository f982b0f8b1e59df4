"""The dual-tower retrieval model: one encoder tower per domain over that domain's training graph.

``RetrievalModel`` is what serving uses (``relaygr.cascade.trained_retrieval``):

- ``item_vectors(domain)``: every item's vector of the domain, ``(num_items, vector_dim)``
  float32 (the FAISS index's rows; ``vector_dim`` is ``dim + 1`` with the popularity prior);
- ``user_vector(domain, item_ids, user=None, partner_item_ids=(), recency=1.0)``: a user's
  vector from its recent items in the domain, and in the partner domain where the tower reads
  them (``SCCDRConfig.partner_items``, ``SCCDRConfig.bridges``) (GraphSAGE over the user's own
  neighbourhood; equal to the full-graph vector when the items are the user's training items,
  ``user`` its id and ``recency`` 1; a repeated item counts once, as in the graph; below 1 the
  newer items weigh more in the mean);
- ``user_vectors(domain)``: every known user's vector (evaluation).

Scores are inner products (of unit vectors under cosine similarity). The full-graph pass is
cached until ``refresh()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from relaygr.errors import ConfigError, InvalidInputError, ItemOutOfRangeError
from relaygr.retrieval.config import Aggregation, Encoder, SCCDRConfig
from relaygr.retrieval.encoders import LightGCNTower, SAGETower, TowerOutput
from relaygr.retrieval.graph import BipartiteGraph, bridge_links, bridged_edges


class DomainTower(nn.Module):
    """One domain's encoder with the adjacency of its training graph.

    ``graph`` is the domain's own training graph (its items are the ones scored and served);
    with ``partner`` (``SCCDRConfig.partner_items``) the encoder propagates over ``graph`` with
    the partner's items appended (``BipartiteGraph.with_partner``), so a user's vector reads
    both domains' items while the tower's output items stay the domain's own; ``bridges``
    (``SCCDRConfig.bridges``) are extra (user, item) edges of propagation only, the
    partner purchases of products this domain lists too (``graph.bridged_edges``)."""

    def __init__(self, graph: BipartiteGraph, cfg: SCCDRConfig,
                 partner: BipartiteGraph | None = None,
                 bridges: np.ndarray | None = None) -> None:
        super().__init__()
        self.graph = graph
        bridged = graph if bridges is None or not len(bridges) else graph.with_edges(bridges)
        self.propagation = bridged if partner is None else bridged.with_partner(partner)
        # SAGE's mean aggregator propagates with D^-1 A; LightGCN and SAGE's sym with
        # D^-1/2 A D^-1/2
        self.symmetric = (cfg.encoder is Encoder.LIGHTGCN
                          or cfg.sage_aggregation is Aggregation.SYM)
        nodes = self.propagation
        if cfg.encoder is Encoder.SAGE:
            # the propagation graph's item degrees: the request-time user side under sym
            self.encoder: nn.Module = SAGETower(nodes.num_users, nodes.num_items, cfg.dim,
                                                cfg.num_layers, cfg.normalize,
                                                cfg.sage_aggregation,
                                                torch.from_numpy(nodes.item_degree()))
        else:
            self.encoder = LightGCNTower(nodes.num_users, nodes.num_items, cfg.dim,
                                         cfg.num_layers, cfg.normalize)
        self.adj = self.adjacency_of(self.propagation)
        self.neighbour_mean = graph.user_item_mean()
        self.temperature = cfg.temperature
        degree = np.bincount(graph.edges[:, 1], minlength=graph.num_items)
        self.log_degree = torch.from_numpy(np.log1p(degree).astype(np.float32))   # (I,)
        self.pop_weight = nn.Parameter(torch.ones(())) if cfg.popularity_prior else None

    @property
    def reads_partner(self) -> bool:
        """Whether the partner's items are nodes of this tower's propagation graph."""
        return self.propagation.num_items != self.graph.num_items

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
        return graph.sym_adjacency() if self.symmetric else graph.mean_adjacency()

    def forward(self, adj: torch.Tensor | None = None) -> TowerOutput:
        """The encoder over ``adj`` (default: the propagation graph's); ``items`` are the
        domain's own (partner items, when read, stay in ``item_states`` only)."""
        out: TowerOutput = self.encoder(self.adj if adj is None else adj)
        if self.reads_partner:
            out = TowerOutput(out.users, out.items[:self.graph.num_items], out.item_states)
        return out


class RetrievalModel(nn.Module):
    """Towers by domain name (the pair's target first)."""

    def __init__(self, graphs: dict[str, BipartiteGraph], cfg: SCCDRConfig,
                 held_out: Mapping[str, np.ndarray] | None = None) -> None:
        """``held_out``: each domain's validation and test (user, item) rows, which its bridges
        never add (``graph.bridged_edges``); the trainer and a loaded run pass their split's."""
        super().__init__()
        self.cfg = cfg
        self.domains = list(graphs)
        partners: dict[str, BipartiteGraph | None] = {d: None for d in graphs}
        # links[d]: partner item -> the item of d taken for the same product (-1: none)
        self.links: dict[str, np.ndarray] = {}
        bridges: dict[str, np.ndarray | None] = {d: None for d in graphs}
        if len(graphs) == 2:
            one, other = graphs
            partner_of = {one: other, other: one}
            if cfg.partner_items:
                partners = {d: graphs[p] for d, p in partner_of.items()}
            if cfg.bridges:
                for d, p in partner_of.items():
                    self.links[d] = bridge_links(graphs[d], graphs[p], cfg.bridge_jaccard)
                    bridges[d] = bridged_edges(graphs[p], self.links[d],
                                               None if held_out is None else held_out.get(d))
        self.towers = nn.ModuleDict({name: DomainTower(g, cfg, partners[name], bridges[name])
                                     for name, g in graphs.items()})
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
    def user_vector(self, domain: str, item_ids: Sequence[int], user: int | None = None,
                    partner_item_ids: Sequence[int] = (), recency: float = 1.0) -> np.ndarray:
        """``(dim,)`` float32 from the user's recent items (module doc). Needs GraphSAGE.

        ``partner_item_ids``: the user's items in the partner domain, read when the tower reads
        them: as nodes of their own (``SCCDRConfig.partner_items``) and through their links to
        this domain's items (``SCCDRConfig.bridges``); refused by a tower that reads neither.
        Either list may be empty, not both (``InvalidInputError``).

        ``recency`` in (0, 1]: ``item_ids`` are events in time order, oldest first, and the k-th
        newest weighs ``recency ** k`` in the tower's mean over the user's items (an item that
        recurs weighs as its newest event). 1: the plain mean of the graph, order ignored. Below
        1 the partner's items have no place in that order and are refused."""
        tower = self.tower(domain)
        if not isinstance(tower.encoder, SAGETower):
            raise ConfigError("user_vector needs the GraphSAGE encoder")
        items = self._item_ids(item_ids, tower.graph.num_items, "item_ids")
        if not 0 < recency <= 1:
            raise InvalidInputError(f"recency must be in (0, 1], got {recency}")
        if recency < 1 and len(partner_item_ids):
            raise InvalidInputError("recency weighs item_ids by their order; partner_item_ids "
                                    "have no place in it")
        if len(partner_item_ids):
            links = self.links.get(domain)
            if not tower.reads_partner and links is None:
                raise ConfigError(f"the {domain} tower reads no partner items (trained without "
                                  "partner_items or bridges)")
            partner = self._item_ids(partner_item_ids, self._partner_items(domain),
                                     "partner_item_ids")
            if links is not None:      # bridged: the partner purchase as this domain's item
                bridged = torch.from_numpy(links[partner.numpy()])
                items = torch.cat([items, bridged[bridged >= 0]])
            if tower.reads_partner:
                items = torch.cat([items, partner + tower.graph.num_items])
        weights = None
        if recency < 1 and len(items):
            newest_first = torch.arange(len(items) - 1, -1, -1, dtype=torch.float64)
            items, inverse = items.unique(return_inverse=True)
            weights = torch.zeros(len(items), dtype=torch.float64).scatter_reduce_(
                0, inverse, recency ** newest_first, reduce="amax")
        else:
            items = items.unique()     # the graph counts a (user, item) edge once
        if len(items) == 0:
            raise InvalidInputError("the user has no item this tower reads (item_ids and "
                                    "partner_item_ids are both empty or unlinked)")
        if user is not None and not 0 <= user < tower.graph.num_users:
            raise InvalidInputError(f"user {user} is not in [0, {tower.graph.num_users})")
        out = self.encode(domain)
        vec = tower.encoder.user_from_items(items, out.item_states, user, weights)
        return tower.served_users(vec[None])[0].numpy().astype(np.float32)

    def _partner_items(self, domain: str) -> int:
        partner = next(d for d in self.domains if d != domain)
        return self.tower(partner).graph.num_items

    @staticmethod
    def _item_ids(ids: Sequence[int], num_items: int, name: str) -> torch.Tensor:
        items = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        if items.ndim != 1:
            raise InvalidInputError(f"{name} must be a list of item ids")
        if len(items) and (items.min() < 0 or items.max() >= num_items):
            raise ItemOutOfRangeError(f"{name} must be in [0, {num_items})")
        return items
