"""Retrieval: FAISS top-K equals brute-force torch top-K; exclusion; IVF; rebuilds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relaygr.cascade.retrieval import (
    IndexKind,
    RetrievalConfig,
    Retriever,
)
from relaygr.errors import ConfigError, InvalidInputError
from relaygr.model import HSTU, HSTUConfig
from tests.tolerance import reorder_tolerance


def brute_force(users: torch.Tensor, table: torch.Tensor, k: int,
                exclude: list[list[int]] | None = None) -> list[set[int]]:
    scores = users @ table.t()                           # [B, num_items]
    if exclude is not None:
        for b, ids in enumerate(exclude):
            scores[b, torch.tensor(ids, dtype=torch.int64) - 1] = -torch.inf
    return [set((row + 1).tolist()) for row in scores.topk(k, dim=1).indices]


def test_flat_index_returns_exactly_the_brute_force_top_k() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(2000, 24, generator=gen)
    users = torch.randn(16, 24, generator=gen)
    result = Retriever(table).search(users, 50)
    assert result.item_ids.shape == (16, 50) and result.item_ids.dtype == np.int64
    assert [set(row.tolist()) for row in result.item_ids] == brute_force(users, table, 50)
    expected = np.take_along_axis((users @ table.t()).numpy(), result.item_ids - 1, axis=1)
    # FAISS and torch sum the 24 products of each dot product in their own orders
    tol = reorder_tolerance(terms=24, abs_sum=float((users.abs() @ table.abs().t()).max()))
    np.testing.assert_allclose(result.scores, expected, rtol=0.0, atol=tol)
    assert np.all(np.diff(result.scores, axis=1) <= 0) and result.valid.all()


def test_excluded_history_items_never_come_back() -> None:
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(300, 8, generator=gen)
    users = torch.randn(3, 8, generator=gen)
    plain = Retriever(table).search(users, 20)
    exclude = [plain.item_ids[0, :5].tolist(), [], [*plain.item_ids[2].tolist(), 1, 1]]
    result = Retriever(table).search(users, 20, exclude=exclude)
    assert [set(r.tolist()) for r in result.item_ids] == brute_force(users, table, 20, exclude)
    assert result.item_ids[1].tolist() == plain.item_ids[1].tolist()
    # The largest k that leaves room for 21 unique exclusions in a 300-item catalogue.
    assert Retriever(table).search(users, 279, exclude=exclude).valid.all()
    with pytest.raises(InvalidInputError, match="k must be"):
        Retriever(table).search(users, 280, exclude=exclude)


def test_ivf_probing_every_list_is_exact_and_few_probes_pad_with_zero() -> None:
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(1200, 16, generator=gen)
    users = torch.randn(8, 16, generator=gen)
    full = Retriever(table, RetrievalConfig(IndexKind.IVF, ivf_lists=8, ivf_probes=8))
    assert [set(r.tolist()) for r in full.search(users, 30).item_ids] == brute_force(
        users, table, 30)
    narrow = Retriever(table, RetrievalConfig(IndexKind.IVF, ivf_lists=8, ivf_probes=1))
    result = narrow.search(users, 1000)
    assert not result.valid.all()
    assert np.all(result.item_ids[~result.valid] == 0)
    assert np.all(np.isneginf(result.scores[~result.valid]))


def test_model_retriever_uses_item_embeddings_and_rebuilds_after_a_change() -> None:
    torch.manual_seed(0)
    model = HSTU(HSTUConfig(num_items=400, dim=16, num_layers=1, num_heads=2,
                            max_seq_len=64)).eval()
    retriever = Retriever.from_model(model)
    kv = model.prefill(torch.randint(1, 401, (20,)))
    user = kv.last_hidden[None]
    with torch.inference_mode():
        expected = model.retrieval_scores(user)[:, 1:].topk(10).indices + 1
    assert set(retriever.search(user, 10).item_ids[0].tolist()) == set(expected[0].tolist())
    assert retriever.is_current(model) and not retriever.refresh(model)
    with torch.no_grad():
        model.item_emb.weight.mul_(-1.0)
    assert not retriever.is_current(model)
    assert retriever.refresh(model) and retriever.is_current(model)
    with torch.inference_mode():
        flipped = model.retrieval_scores(user)[:, 1:].topk(10).indices + 1
    assert set(flipped[0].tolist()) != set(expected[0].tolist())   # a stale index would fail
    assert set(retriever.search(user, 10).item_ids[0].tolist()) == set(flipped[0].tolist())


def test_bad_queries_and_configs_are_typed_errors() -> None:
    retriever = Retriever(np.eye(4, dtype=np.float32))
    with pytest.raises(InvalidInputError, match=r"\[B, 4\]"):
        retriever.search(np.ones((2, 3), dtype=np.float32), 1)
    with pytest.raises(InvalidInputError, match="rows"):
        retriever.search(np.ones((2, 4), dtype=np.float32), 1, exclude=[[1]])
    with pytest.raises(InvalidInputError, match="outside"):
        retriever.search(np.ones((1, 4), dtype=np.float32), 1, exclude=[[5]])
    with pytest.raises(InvalidInputError, match="k must be"):
        retriever.search(np.ones((1, 4), dtype=np.float32), 0)
    with pytest.raises(ConfigError, match="exceeds"):
        Retriever(np.eye(4, dtype=np.float32), RetrievalConfig(IndexKind.IVF, ivf_lists=5))
    assert RetrievalConfig.from_dict({"kind": "ivf", "ivf_lists": 4}) == RetrievalConfig(
        IndexKind.IVF, ivf_lists=4)
    with pytest.raises(ConfigError, match=r"RetrievalConfig\.kind: Input should be 'flat' or"):
        RetrievalConfig.from_dict({"kind": "hnsw"})
    with pytest.raises(ConfigError, match="unknown RetrievalConfig keys"):
        RetrievalConfig.from_dict({"nlist": 4})
