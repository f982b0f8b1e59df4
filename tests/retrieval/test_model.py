"""Graphs, towers and the serving API on a tiny graph."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
import torch

from relaygr.errors import ConfigError, InvalidInputError, ItemOutOfRangeError
from relaygr.retrieval.config import Aggregation, Encoder, Pacing, SCCDRConfig, Similarity
from relaygr.retrieval.encoders import SAGETower
from relaygr.retrieval.graph import BipartiteGraph, bridge_links, bridged_edges
from relaygr.retrieval.model import RetrievalModel

EDGES = np.array([[0, 0], [0, 1], [1, 1], [2, 2], [3, 0], [3, 1], [3, 2]])
# float32 sums of a few terms of size ~1: a few ulps (eps 1.19e-7) of error, never more
TOL = 8 * float(np.finfo(np.float32).eps)


def test_adjacencies() -> None:
    g = BipartiteGraph(5, 4, EDGES)                    # user 4 and item 3 are isolated
    mean = g.mean_adjacency().to_dense().numpy()
    sums = mean.sum(axis=1)
    np.testing.assert_allclose(sums[[0, 1, 2, 3, 5, 6, 7]], 1.0, atol=TOL)
    assert sums[4] == 0 and sums[8] == 0
    assert mean[0, 5] == 0.5 and mean[3, 7] == pytest.approx(1 / 3, abs=TOL)
    sym = g.sym_adjacency().to_dense().numpy()
    np.testing.assert_allclose(sym, sym.T, atol=TOL)
    # user 3 (degree 3) - item 0 (node 5, degree 2): 1 / sqrt(3 * 2)
    assert sym[3, 5] == pytest.approx(1 / np.sqrt(6), abs=TOL)
    assert [a.tolist() for a in g.items_of()] == [[0, 1], [1], [2], [0, 1, 2], []]


@pytest.mark.parametrize("aggregation", ["mean", "sym"])
@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_user_vector_from_items_equals_the_full_graph_vector(similarity: str,
                                                             aggregation: str) -> None:
    torch.manual_seed(0)
    cfg = SCCDRConfig(dim=8, num_layers=2, similarity=Similarity(similarity),
                      sage_aggregation=Aggregation(aggregation))
    model = RetrievalModel({"a": BipartiteGraph(5, 4, EDGES)}, cfg)
    users, items = model.user_vectors("a"), model.item_vectors("a")
    assert users.dtype == np.float32 and items.shape == (4, 9) and items.flags.c_contiguous
    np.testing.assert_allclose(model.user_vector("a", [0, 1, 2], user=3), users[3], atol=TOL)
    np.testing.assert_allclose(model.user_vector("a", [1], user=1), users[1], atol=TOL)
    cold = model.user_vector("a", [0, 1])             # unseen user: no ID embedding
    assert cold.shape == (9,) and np.isfinite(cold).all()
    with pytest.raises(ItemOutOfRangeError):
        model.user_vector("a", [4])
    with pytest.raises(InvalidInputError):
        model.user_vector("a", [])
    with pytest.raises(InvalidInputError):
        model.user_vector("b", [0])


@pytest.mark.parametrize("aggregation", ["mean", "sym"])
def test_recency_weighs_each_item_by_its_newest_event(aggregation: str) -> None:
    torch.manual_seed(0)
    cfg = SCCDRConfig(dim=8, num_layers=2, sage_aggregation=Aggregation(aggregation))
    model = RetrievalModel({"a": BipartiteGraph(5, 4, EDGES)}, cfg)
    events, r = [2, 0, 1, 0], 0.5          # oldest first; item 0 recurs and is also the newest
    encoder = cast(SAGETower, model.tower("a").encoder)
    states = model.encode("a").item_states
    weights = {0: r ** 0, 1: r ** 1, 2: r ** 3}           # its newest event's weight
    # sym: a share s_i becomes s_i sqrt(n / deg(i)); n = 3 items, degrees 2, 3, 2 (EDGES)
    scale = ({0: np.sqrt(3 / 2), 1: 1.0, 2: np.sqrt(3 / 2)} if aggregation == "sym"
             else {0: 1.0, 1: 1.0, 2: 1.0})
    with torch.no_grad():
        h = encoder.user_emb.weight[3]
        for layer, layer_states in enumerate(states):
            agg = torch.stack([w * scale[i] * layer_states[i].double()
                               for i, w in weights.items()]).sum(0)
            h = encoder._step(layer, h, (agg / sum(weights.values())).float())
        want = torch.cat([torch.nn.functional.normalize(h, dim=-1), torch.ones(1)]).numpy()
    np.testing.assert_allclose(model.user_vector("a", events, user=3, recency=r), want, atol=TOL)
    # recency 1 is the graph's plain mean, order ignored: the trained vector again
    np.testing.assert_allclose(model.user_vector("a", events, user=3, recency=1.0),
                               model.user_vectors("a")[3], atol=TOL)
    for bad in (0.0, 1.5):
        with pytest.raises(InvalidInputError, match="recency"):
            model.user_vector("a", events, user=3, recency=bad)


def test_sym_aggregation_propagates_with_the_symmetric_adjacency() -> None:
    """``sage_aggregation`` "sym": the tower's adjacency is D^-1/2 A D^-1/2 (of the propagation
    graph, views included), the default stays the mean, and a run.json written before the
    option (no such key) loads as the mean."""
    g = BipartiteGraph(5, 4, EDGES)
    torch.manual_seed(0)
    mean = RetrievalModel({"a": g}, SCCDRConfig(dim=8))
    torch.manual_seed(0)
    sym = RetrievalModel({"a": g}, SCCDRConfig(dim=8, sage_aggregation=Aggregation.SYM))
    np.testing.assert_array_equal(mean.tower("a").adj.to_dense(), g.mean_adjacency().to_dense())
    np.testing.assert_array_equal(sym.tower("a").adj.to_dense(), g.sym_adjacency().to_dense())
    view = g.drop_edges(0.3, np.random.default_rng(0))
    np.testing.assert_array_equal(sym.tower("a").adjacency_of(view).to_dense(),
                                  view.sym_adjacency().to_dense())
    encoder = cast(SAGETower, sym.tower("a").encoder)
    assert encoder.item_scale is not None
    # degrees 2, 3, 2 and 0 (item 3 never trained: taken as 1)
    np.testing.assert_allclose(encoder.item_scale, 1 / np.sqrt([2, 3, 2, 1]), atol=TOL)
    assert cast(SAGETower, mean.tower("a").encoder).item_scale is None
    # the same weights, another aggregator: another vector for the user of degree 3
    assert not np.allclose(sym.user_vectors("a")[3], mean.user_vectors("a")[3], atol=1e-3)
    old = SCCDRConfig().to_dict()
    del old["sage_aggregation"]
    assert SCCDRConfig.from_dict(old).sage_aggregation is Aggregation.MEAN
    assert SCCDRConfig.from_dict(SCCDRConfig(sage_aggregation=Aggregation.SYM).to_dict()) \
        .sage_aggregation is Aggregation.SYM
    with pytest.raises(ConfigError, match="sage_aggregation"):
        SCCDRConfig(encoder=Encoder.LIGHTGCN, sage_aggregation=Aggregation.SYM)
    with pytest.raises(ConfigError, match="sage_aggregation"):
        SCCDRConfig().with_(sage_aggregation="max")


def test_lightgcn_has_no_request_time_user_tower() -> None:
    model = RetrievalModel({"a": BipartiteGraph(5, 4, EDGES)},
                           SCCDRConfig(encoder=Encoder.LIGHTGCN, dim=4))
    assert model.item_vectors("a").shape == (4, 5)   # dim + the popularity column
    with pytest.raises(ConfigError):
        model.user_vector("a", [0])


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        SCCDRConfig(stop_gradient="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SCCDRConfig(edge_dropout=1.0)
    with pytest.raises(ConfigError):
        SCCDRConfig(inter_negatives=65, pool_size=64)
    with pytest.raises(ConfigError):
        SCCDRConfig().with_(no_such_key=1)
    cfg = SCCDRConfig(pacing=Pacing.ROOT)
    assert SCCDRConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("shared", [False, True])
def test_share_user_embedding_ties_the_towers_user_table(shared: bool) -> None:
    torch.manual_seed(0)
    cfg = SCCDRConfig(dim=8, share_user_embedding=shared)
    graphs = {"a": BipartiteGraph(5, 4, EDGES), "b": BipartiteGraph(5, 3, EDGES[EDGES[:, 1] < 3])}
    model = RetrievalModel(graphs, cfg)
    a, b = model.tower("a").encoder.user_emb, model.tower("b").encoder.user_emb
    assert (a is b) == shared
    # one table counts once among the parameters (the optimiser steps it once)
    tables = 1 if shared else 2
    assert sum(p.shape == (5, 8) for p in model.parameters()) == tables
    copy = RetrievalModel(graphs, cfg)
    copy.load_state_dict(model.state_dict())
    np.testing.assert_array_equal(copy.user_vectors("b"), model.user_vectors("b"))
    assert (copy.tower("a").encoder.user_emb is copy.tower("b").encoder.user_emb) == shared


@pytest.mark.parametrize("aggregation", ["mean", "sym"])
def test_partner_items_extend_the_user_side_only(aggregation: str) -> None:
    """With ``partner_items`` a tower reads the user's items of both domains: the request-time
    user vector from both lists equals the full-graph one, and only the domain's own items are
    scored and served."""
    torch.manual_seed(0)
    b_edges = np.array([[0, 2], [1, 0], [3, 1], [3, 2], [4, 0]])   # user 4 has b items only
    graphs = {"a": BipartiteGraph(5, 4, EDGES), "b": BipartiteGraph(5, 3, b_edges)}
    model = RetrievalModel(graphs, SCCDRConfig(dim=8, partner_items=True,
                                               sage_aggregation=Aggregation(aggregation)))
    tower = model.tower("a")
    assert tower.reads_partner and tower.propagation.num_items == 7
    assert tower.propagation.edges[len(EDGES):].tolist() == (b_edges + np.array([0, 4])).tolist()
    users, items = model.user_vectors("a"), model.item_vectors("a")
    assert items.shape == (4, 9) and model.item_vectors("b").shape == (3, 9)
    np.testing.assert_allclose(model.user_vector("a", [0, 1, 2], user=3, partner_item_ids=[1, 2]),
                               users[3], atol=TOL)
    np.testing.assert_allclose(model.user_vector("b", [1, 2], user=3, partner_item_ids=[0, 1, 2]),
                               model.user_vectors("b")[3], atol=TOL)
    # the partner's items change the vector: without them it is another user's view
    alone = model.user_vector("a", [0, 1, 2], user=3)
    assert not np.allclose(alone, users[3], atol=1e-3)
    with pytest.raises(ItemOutOfRangeError):
        model.user_vector("a", [0], partner_item_ids=[3])      # b has items 0..2
    with pytest.raises(InvalidInputError, match="no place"):   # recency orders item_ids alone
        model.user_vector("a", [0], partner_item_ids=[1], recency=0.5)
    # user 4 has b items only: they alone give its vector in a's tower
    np.testing.assert_allclose(model.user_vector("a", [], user=4, partner_item_ids=[0]),
                               users[4], atol=TOL)
    with pytest.raises(InvalidInputError):
        model.user_vector("a", [], partner_item_ids=[])
    plain = RetrievalModel(graphs, SCCDRConfig(dim=8))
    assert not plain.tower("a").reads_partner
    with pytest.raises(ConfigError):
        plain.user_vector("a", [0], partner_item_ids=[0])
    # a single-domain model has no partner to read, whatever the flag
    solo = RetrievalModel({"a": graphs["a"]}, SCCDRConfig(dim=8, partner_items=True))
    assert not solo.tower("a").reads_partner


def test_bridge_links_pair_items_bought_by_the_same_users() -> None:
    # target items 0-3, partner items 0-3 over users 0-5
    target = BipartiteGraph(6, 4, np.array([[0, 0], [1, 0], [2, 1], [3, 1], [3, 2],
                                            [4, 3], [5, 3], [4, 2]]))
    partner = BipartiteGraph(6, 4, np.array([[0, 0], [1, 0], [4, 0],     # t0: 2 of 3 users
                                             [2, 1], [3, 1],             # t1: the same users
                                             [3, 2],                     # one user: too few
                                             [4, 3], [5, 3]]))           # t3: 1.0, t2: 1/3
    links = bridge_links(target, partner, min_jaccard=0.3)
    assert links.tolist() == [0, 1, -1, 3]          # p3: the better of t3 and t2
    assert bridge_links(target, partner, min_jaccard=0.7).tolist() == [-1, 1, -1, 3]
    edges = bridged_edges(partner, links)
    assert edges.tolist() == [[0, 0], [1, 0], [2, 1], [3, 1], [4, 0], [4, 3], [5, 3]]
    # two targets with the same users: the lower id, whatever the order of the rows
    twin = BipartiteGraph(6, 3, np.array([[4, 2], [5, 2], [4, 1], [5, 1]]))
    assert bridge_links(twin, partner, min_jaccard=0.5).tolist() == [-1, -1, -1, 1]


@pytest.mark.parametrize("aggregation", ["mean", "sym"])
def test_bridges_add_propagation_edges_and_the_request_time_tower_follows(aggregation: str
                                                                          ) -> None:
    torch.manual_seed(0)
    a = np.array([[0, 0], [1, 0], [2, 1], [3, 1], [3, 2]])
    b = np.array([[0, 0], [1, 0], [4, 0], [2, 1], [3, 1], [3, 2]])
    graphs = {"a": BipartiteGraph(5, 3, a), "b": BipartiteGraph(5, 3, b)}
    model = RetrievalModel(graphs, SCCDRConfig(dim=8, bridges=True,
                                               sage_aggregation=Aggregation(aggregation)))
    tower = model.tower("a")
    assert not tower.reads_partner and tower.propagation.num_items == 3
    # user 4 bought partner item 0, linked to a's item 0: an edge of a's propagation graph only
    assert [4, 0] in tower.propagation.edges.tolist()
    assert [4, 0] not in tower.graph.edges.tolist()
    assert tower.log_degree[0] == pytest.approx(np.log1p(2))     # the prior counts real rows
    users = model.user_vectors("a")
    # user 4 has no item of a: its partner purchase alone gives its vector
    np.testing.assert_allclose(model.user_vector("a", [], user=4, partner_item_ids=[0]),
                               users[4], atol=TOL)
    # user 3's partner items 1 and 2: item 1 is already its own, item 2 has no link; a repeated
    # item counts once, as in the graph
    np.testing.assert_allclose(model.user_vector("a", [1, 2, 2], user=3,
                                                 partner_item_ids=[1, 2, 1]),
                               users[3], atol=TOL)
    with pytest.raises(InvalidInputError):
        model.user_vector("a", [], user=3, partner_item_ids=[2])   # nothing the tower reads


def test_a_held_out_pair_never_becomes_a_bridged_edge() -> None:
    """A cross-listed product is one purchase in both catalogues: user 0's held-out item 0 of
    domain a has its twin (b's item 0, bought by the same users) among b's training rows. The
    bridge must not put (0, 0) back into a's graph: the user's vector would aggregate the very
    item it is evaluated on."""
    from relaygr.retrieval.splits import DomainSplit, SplitKind
    from relaygr.retrieval.trainer import RetrievalTrainer

    a_train = np.array([[1, 0], [2, 0], [3, 1], [4, 1], [4, 2]])
    b_train = np.array([[0, 0], [1, 0], [2, 0], [3, 1], [4, 1]])     # b0 ~ a0, b1 ~ a1
    held_a = np.array([[0, 0]])
    graphs = {"a": BipartiteGraph(5, 3, a_train), "b": BipartiteGraph(5, 2, b_train)}
    cfg = SCCDRConfig(dim=8, bridges=True)
    leaky = RetrievalModel(graphs, cfg)              # no held-out rows given: the twin's edge
    assert [0, 0] in leaky.tower("a").propagation.edges.tolist()
    model = RetrievalModel(graphs, cfg, {"a": held_a})
    edges = model.tower("a").propagation.edges.tolist()
    assert [0, 0] not in edges and [3, 1] in edges    # other bridged purchases stay

    none = np.zeros((0, 2), dtype=np.int64)
    splits = {"a": DomainSplit("a", SplitKind.CVGAE, 3, a_train, none, held_a,
                               np.zeros((0, 1), dtype=np.int64), np.array([[2]])),
              "b": DomainSplit("b", SplitKind.CVGAE, 2, b_train, none, none,
                               np.zeros((0, 1), dtype=np.int64), np.zeros((0, 1), dtype=np.int64))}
    small = cfg.with_(pool_size=3, inter_negatives=2)        # 5 users: a small curriculum pool
    trained = RetrievalTrainer(small, splits, 5, 0, progress_bar=False).model
    assert [0, 0] not in trained.tower("a").propagation.edges.tolist()
