"""Causal matching on time-ordered data: the split records each training row's place in its
user's time order, and the matching loss meets a positive with the user vector of the items
just before it, exactly as serving computes a user from its latest events."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.errors import ConfigError
from relaygr.retrieval.config import PRESETS, SCCDRConfig
from relaygr.retrieval.data import Domain
from relaygr.retrieval.splits import DomainSplit, SplitKind, make_split, time_positions
from relaygr.retrieval.trainer import RetrievalTrainer

USERS = 30


def _domain(time_ordered: bool = True, per_user: int = 12, num_items: int = 1100) -> Domain:
    """Each user's rows in time order (as ``load_movielens`` leaves them), the last held out."""
    rng = np.random.default_rng(0)
    rows = [(u, int(i)) for u in range(USERS)
            for i in rng.choice(num_items, size=per_user + 1, replace=False)]
    pairs = np.asarray(rows, dtype=np.int64)
    last = np.r_[pairs[1:, 0] != pairs[:-1, 0], True]
    return Domain("d", Path("."), pairs[~last], pairs[last], pairs[last], num_items, "x",
                  time_ordered=time_ordered)


def test_a_time_ordered_split_records_each_rows_place_and_keeps_its_rows(
        tmp_path: Path) -> None:
    domain = _domain()
    split = make_split(domain, SplitKind.DISENCDR, 0, 0.5)
    assert split.train_pos is not None
    np.testing.assert_array_equal(domain.train[split.train_pos], split.train)
    split.save(tmp_path / "d.npz")
    loaded = DomainSplit.load(tmp_path / "d.npz", "d").train_pos
    assert loaded is not None
    np.testing.assert_array_equal(loaded, split.train_pos)
    unordered = make_split(_domain(time_ordered=False), SplitKind.DISENCDR, 0, 0.5)
    np.testing.assert_array_equal(unordered.train, split.train)   # the same rows either way
    assert unordered.train_pos is None
    unordered.save(tmp_path / "u.npz")
    assert DomainSplit.load(tmp_path / "u.npz", "u").train_pos is None
    # a repeated (user, item) takes its last place; a row the sequence lacks is the newest
    seq = np.array([[0, 5], [0, 6], [0, 5], [1, 5]])
    assert time_positions(np.array([[0, 5], [0, 6], [1, 5], [1, 6]]), seq).tolist() == \
        [2, 1, 3, 4]


@pytest.mark.parametrize("aggregation", ["mean", "sym"])
def test_causal_user_vectors_are_the_served_vectors_of_the_items_before(aggregation: str
                                                                        ) -> None:
    split = make_split(_domain(), SplitKind.DISENCDR, 0, 0.5)
    assert split.train_pos is not None
    cfg = PRESETS["single"].with_(dim=8, causal_window=4, causal_recency=0.7,
                                  sage_aggregation=aggregation)
    trainer = RetrievalTrainer(cfg, {"d": split}, USERS, 0, progress_bar=False)
    model = trainer.model
    out = model.tower("d")()
    rows = torch.arange(len(split.train))
    batch = torch.cat([torch.from_numpy(split.train), rows[:, None]], dim=1)
    kept, vecs = trainer._causal_users("d", out, batch)
    assert len(kept) == len(batch) - len(np.unique(split.train[:, 0]))   # first items drop
    for row, vec in list(zip(kept[:, 2].tolist(), vecs, strict=True))[::17]:
        u, pos = split.train[row, 0], split.train_pos[row]
        mine = np.flatnonzero((split.train[:, 0] == u) & (split.train_pos < pos))
        before = split.train[mine[np.argsort(split.train_pos[mine])], 1][-4:]
        served = model.user_vector("d", before.tolist(), int(u), recency=0.7)
        np.testing.assert_allclose(served[:8], vec.detach().numpy(), atol=1e-5)


def test_only_a_time_ordered_graphsage_domain_trains_causally() -> None:
    ordered = make_split(_domain(), SplitKind.DISENCDR, 0, 0.5)
    unordered = make_split(_domain(time_ordered=False), SplitKind.DISENCDR, 0, 0.5)
    single = PRESETS["single"].with_(dim=8)
    assert single.causal_window > 0                  # the default where order exists
    assert set(RetrievalTrainer(single, {"d": ordered}, USERS, 0,
                                progress_bar=False).sequences) == {"d"}
    assert not RetrievalTrainer(single, {"d": unordered}, USERS, 0,
                                progress_bar=False).sequences
    assert not RetrievalTrainer(single.with_(causal_window=0), {"d": ordered}, USERS, 0,
                                progress_bar=False).sequences
    assert not RetrievalTrainer(PRESETS["lightgcn"].with_(dim=8), {"d": ordered}, USERS, 0,
                                progress_bar=False).sequences
    assert not RetrievalTrainer(single, {"d": ordered, "e": ordered}, USERS, 0,   # two domains
                                progress_bar=False).sequences
    assert SCCDRConfig().causal_window == 0      # an older run.json loads as it was trained


def test_a_batch_of_first_items_only_trains_on() -> None:
    """Every user with one training item: no positive has an item before it, so the matching
    term is empty, and the step still runs."""
    split = make_split(_domain(per_user=2), SplitKind.DISENCDR, 0, 1.0)   # one item each left
    assert split.train_pos is not None and len(np.unique(split.train[:, 0])) == len(split.train)
    cfg = PRESETS["single"].with_(dim=8, batch_size=16, num_negatives=8, max_epochs=1)
    result = RetrievalTrainer(cfg, {"d": split}, USERS, 0, progress_bar=False).fit()
    assert result.history[0]["loss"]["match"] == 0.0


def test_causal_training_is_deterministic_and_learns() -> None:
    split = make_split(_domain(), SplitKind.DISENCDR, 0, 0.5)
    cfg = PRESETS["single"].with_(dim=8, batch_size=64, num_negatives=16, max_epochs=2,
                                  causal_window=4)
    a = RetrievalTrainer(cfg, {"d": split}, USERS, 3, progress_bar=False).fit()
    b = RetrievalTrainer(cfg, {"d": split}, USERS, 3, progress_bar=False).fit()
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    assert a.history[-1]["loss"]["match"] < a.history[0]["loss"]["match"]


@pytest.mark.parametrize("bad", [{"causal_window": -1}, {"causal_recency": 0.0},
                                 {"causal_recency": 1.5}])
def test_causal_options_are_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="causal"):
        SCCDRConfig().with_(**bad)
