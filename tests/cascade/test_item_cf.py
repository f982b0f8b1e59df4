"""The item-to-item channel (``relaygr.cascade.item_cf``): the cosine table worked by hand, its
neighbour cut, the request's recency-weighted sum, exclusion and refusal; and as a third channel
of a served retrieval run (``trained_retrieval.beside_the_default``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from relaygr.cascade.config import StagesConfig
from relaygr.cascade.item_cf import ItemCFRetrieval, ItemNeighbours
from relaygr.cascade.proposals import EmbeddingRetrieval, InterleavedRetrieval
from relaygr.cascade.trained_retrieval import RankerCatalogue, TrainedRetrieval, beside_the_default
from relaygr.errors import ConfigError, EmptyInputError
from relaygr.retrieval.checkpoint import read_run_info
from tests.cascade.retrieval_runs import MOVIES, train_run, write_ratings
from tests.model.helpers import make_model

# users 7 and 8 buy items 1 and 2, user 8 also 3, user 9 buys 3 and 4 (user 7 buys 1 twice):
# item users 1 {7, 8}, 2 {7, 8}, 3 {8, 9}, 4 {9}
USERS = np.array([7, 7, 7, 8, 8, 8, 9, 9])
ITEMS = np.array([1, 2, 1, 1, 2, 3, 3, 4])
COSINE = {(1, 2): 1.0, (1, 3): 0.5, (2, 3): 0.5, (3, 4): 2 ** -0.5}


def _cos(i: int, j: int) -> float:
    return COSINE.get((min(i, j), max(i, j)), 0.0)


def test_the_table_is_the_cosine_over_shared_users_cut_to_the_nearest_neighbours() -> None:
    full = ItemNeighbours.of_rows(USERS, ITEMS, 5, neighbours=4).table.toarray()
    want = np.array([[_cos(i, j) if i != j else 0.0 for j in range(6)] for i in range(6)])
    want[0, :] = want[:, 0] = 0.0
    np.testing.assert_allclose(full, want, rtol=1e-6)     # item 5: no user, an empty row
    # two neighbours: item 3 keeps 4 (0.71) and, of 1 and 2 (both 0.5), the lower id
    cut = ItemNeighbours.of_rows(USERS, ITEMS, 5, neighbours=2).table
    assert sorted(cut[3].indices.tolist()) == [1, 4]
    np.testing.assert_allclose(cut[3].toarray().ravel()[[1, 4]], [0.5, 2 ** -0.5], rtol=1e-6)
    assert all(cut[i].nnz <= 2 for i in range(6))
    with pytest.raises(ConfigError, match="neighbours >= 1"):
        ItemNeighbours.of_rows(USERS, ITEMS, 5, neighbours=0)
    with pytest.raises(ConfigError, match=r"items 1 \.\. 3"):
        ItemNeighbours.of_rows(USERS, ITEMS, 3, neighbours=2)


def test_a_request_sums_its_latest_events_rows_by_recency() -> None:
    stage = ItemCFRetrieval(ItemNeighbours.of_rows(USERS, ITEMS, 5, neighbours=4),
                            recent_events=2, recency=0.5)
    # events oldest first: 4 falls outside the window of 2; 3 (newest) weighs 1, 1 weighs 0.5
    ids, scores = stage.scored(np.array([4, 1, 3]), 10)
    want = {j: _cos(3, j) + 0.5 * _cos(1, j) for j in (1, 2, 3, 4)}
    assert ids.tolist() == [2, 4, 1, 3]              # 1.0, 0.71, 0.5, 0.25
    np.testing.assert_allclose(scores, [want[j] for j in ids.tolist()], rtol=1e-6)
    assert stage.scored(np.array([4, 1, 3]), 2)[0].tolist() == [2, 4]
    # 3 alone: 4 (0.71), then 1 and 2 tie at 0.5, the lower id first, also where k cuts them
    assert stage.scored(np.array([3]), 10)[0].tolist() == [4, 1, 2]
    assert stage.scored(np.array([3]), 2)[0].tolist() == [4, 1]
    assert stage.propose(np.array([4, 1, 3]), 10, user_id=12).tolist() == ids.tolist()
    left = stage.scored(np.array([4, 1, 3]), 10, exclude=np.array([1, 3, 4]))[0]
    assert left.tolist() == [2]                       # only co-occurring items, never excluded


def test_a_user_with_no_neighbouring_event_is_refused_and_bad_ids_too() -> None:
    stage = ItemCFRetrieval(ItemNeighbours.of_rows(USERS, ITEMS, 5, neighbours=4),
                            recent_events=4, recency=1.0)
    with pytest.raises(EmptyInputError, match="item-CF neighbour"):
        stage.scored(np.array([5]), 10)               # item 5 co-occurs with nothing
    with pytest.raises(EmptyInputError):
        stage.scored(np.array([], dtype=np.int64), 10)
    with pytest.raises(ConfigError, match=r"1 \.\. 5"):
        stage.scored(np.array([6]), 10)
    with pytest.raises(ConfigError, match="recent_events >= 1"):
        ItemCFRetrieval(stage.neighbours, recent_events=0, recency=1.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retrieval")
    write_ratings(root / "ml")
    return train_run(root / "ml", root / "run")


def test_a_served_run_adds_the_item_to_item_channel_of_its_training_rows(run: Path) -> None:
    """Three channels in the configured shares: the item embeddings, the run's towers and the
    item-to-item channel over the run's own training interactions, in the ranker's ids."""
    ranker = np.sort(MOVIES)
    model = make_model(0, num_items=len(ranker), max_seq_len=64)
    stages = StagesConfig(retrieval_history=6, retrieval_run_share=0.4,
                          retrieval_item_cf_rest_share=0.75, retrieval_item_cf_neighbours=20)
    stage = TrainedRetrieval.load(run, RankerCatalogue("ml-1m", ranker), 6, recency=0.7)
    served = beside_the_default(stage, stages, model)
    assert isinstance(served, InterleavedRetrieval)
    default, towers, item_cf = served.channels
    assert isinstance(default, EmbeddingRetrieval) and towers is stage
    assert isinstance(item_cf, ItemCFRetrieval) and item_cf.name.startswith("item-cf of ")
    np.testing.assert_allclose(served.shares, [0.15, 0.4, 0.45])
    assert (item_cf.recent_events, item_cf.recency) == (6, 0.7)
    assert stage.train_rows is not None
    _check_table(item_cf.neighbours.table, run, ranker, stage.train_rows, 20)
    # the default stage's share may go to zero: the run and its item-to-item channel alone
    both = beside_the_default(stage, StagesConfig(retrieval_run_share=0.5,
                                                  retrieval_item_cf_rest_share=1.0), model)
    assert isinstance(both, InterleavedRetrieval) and both.channels[0] is stage
    np.testing.assert_allclose(both.shares, [0.5, 0.5])


def test_items_the_ranker_does_not_know_stay_out_of_the_table(run: Path) -> None:
    """A ranker without every 7th of the run's movies and with 20 of its own: the table holds
    only items both know, mapped through the dataset's ids."""
    ranker = np.sort(np.concatenate([np.delete(MOVIES, np.s_[::7]),
                                     np.arange(5000, 5020, dtype=np.int64)]))
    stage = TrainedRetrieval.load(run, RankerCatalogue("ml-1m", ranker), 6, recency=0.7)
    assert stage.train_rows is not None
    table = stage.item_neighbours(20).table
    named = np.union1d(table.indices, np.flatnonzero(np.diff(table.indptr)))
    assert np.isin(ranker[named - 1], np.delete(MOVIES, np.s_[::7])).all()
    _check_table(table, run, ranker, stage.train_rows, 20)


def _check_table(table: sp.csr_matrix, run: Path, ranker: np.ndarray, rows: np.ndarray,
                 neighbours: int) -> None:
    """``table`` is the cosine table of ``rows`` (the run's ids) written in the ranker's ids,
    the mapping taken independently: run item -> the dataset's id -> its place in ``ranker``."""
    with np.load(run / "catalogue.npz") as z:
        movies = z[f"items/{read_run_info(run).domains[0]}"]
    dataset_ids = movies[rows[:, 1]]
    known = np.isin(dataset_ids, ranker)
    items = np.searchsorted(ranker, dataset_ids[known]) + 1
    want = ItemNeighbours.of_rows(rows[known, 0], items, len(ranker), neighbours).table
    assert (table != want).nnz == 0


def test_the_item_to_item_channel_takes_its_share_of_what_the_run_leaves() -> None:
    assert StagesConfig(retrieval_run_share=0.5, retrieval_item_cf_rest_share=0.5
                        ).retrieval_shares == (0.25, 0.5, 0.25)
    assert StagesConfig(retrieval_run_share=1.0).retrieval_shares == (0.0, 1.0, 0.0)
    assert StagesConfig(retrieval_item_cf_rest_share=0.0).retrieval_shares[2] == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="retrieval_item_cf_rest_share must be in"):
            StagesConfig(retrieval_item_cf_rest_share=bad)
