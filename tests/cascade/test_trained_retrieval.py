"""A trained retrieval run as the cascade's retrieval stage: exact top-K of its vectors, ids
mapped through the dataset's, unknown items dropped, mismatched runs refused, time measured."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from relaygr.cascade.config import MEASURED_STAGE_DELAYS, StagesConfig, SystemConfig
from relaygr.cascade.proposals import EmbeddingRetrieval, InterleavedRetrieval
from relaygr.cascade.stages import EarlierStages
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.trained_retrieval import (
    RankerCatalogue,
    TrainedRetrieval,
    beside_the_default,
)
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.engine.instance import InstanceConfig
from relaygr.errors import CatalogueMismatchError, ConfigError, EmptyInputError
from tests.cascade.retrieval_runs import (
    MOVIES,
    USERS,
    brute_force,
    load_run,
    train_run,
    write_ratings,
)
from tests.engine.helpers import flops_cost_model
from tests.model.helpers import make_model
from tests.virtual_time import run_virtual

RECENT = 6
RECENCY = 0.7      # below 1: the window's order counts
# The ranker lacks every 7th movie and knows 20 the run never saw: both sides have items the
# other cannot name.
PARTIAL = np.sort(np.concatenate([np.delete(MOVIES, np.s_[::7]),
                                  np.arange(5000, 5020, dtype=np.int64)]))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retrieval")
    write_ratings(root / "ml")
    return train_run(root / "ml", root / "run")


def _histories(ranker: np.ndarray, seed: int = 0) -> dict[int, np.ndarray]:
    """Each user's events as ranker ids: some of the run's items, some unknown to it."""
    rng = np.random.default_rng(seed)
    return {int(u): rng.integers(1, len(ranker) + 1, size=int(rng.integers(3, 20)))
            for u in USERS[:12]}


@pytest.mark.parametrize("ranker", [np.sort(MOVIES), PARTIAL], ids=["same", "partial"])
def test_proposals_are_the_exact_top_k_of_the_runs_vectors(run: Path, ranker: np.ndarray
                                                           ) -> None:
    stage = TrainedRetrieval.load(run, RankerCatalogue("ml-1m", ranker), RECENT, recency=RECENCY)
    known = set(np.flatnonzero(np.isin(ranker, MOVIES)) + 1)
    for user, history in _histories(ranker).items():
        if not np.isin(ranker[history - 1], load_run(run)[3]).any():   # nothing it trained on
            with pytest.raises(EmptyInputError, match=f"none of the user's {len(history)} events"):
                stage.propose(history, 40, user)
            continue
        for user_id in (user, None):                 # a user the run trained on, and a new one
            got = stage.propose(history, 40, user_id)
            brute_force(run, ranker, history, user_id, RECENT, RECENCY).check(got, 40)
            assert set(got.tolist()) <= known        # never an item the ranker cannot score


def test_the_window_holds_the_latest_events_of_items_the_run_knows(run: Path) -> None:
    stage = TrainedRetrieval.load(run, RankerCatalogue("ml-1m", PARTIAL), RECENT,
                                  recency=RECENCY)
    run_movies = load_run(run)[3]
    known = np.flatnonzero(np.isin(PARTIAL, run_movies)) + 1   # ranker ids of its movies
    unknown = np.flatnonzero(~np.isin(PARTIAL, run_movies)) + 1
    # known and unknown events interleaved, the newest unknown: the window holds the latest
    # RECENT known events, and their ages count known events only (the newest known weighs 1)
    history = np.stack([known[:RECENT + 2], unknown[:RECENT + 2]], axis=1).reshape(-1)
    window = known[2:RECENT + 2]
    run_ids = [int(np.flatnonzero(run_movies == PARTIAL[i - 1])[0]) for i in window.tolist()]
    np.testing.assert_array_equal(stage.user_vector(history),
                                  stage.model.user_vector(stage.domain, run_ids,
                                                          recency=RECENCY))
    np.testing.assert_array_equal(stage.user_vector(history), stage.user_vector(window))
    with pytest.raises(EmptyInputError, match=f"none of the user's {RECENT} events"):
        stage.user_vector(unknown[:RECENT])


def test_the_served_stages_refuse_a_window_or_recency_out_of_range(run: Path) -> None:
    model = make_model(0, num_items=20)
    for recent, recency in ((0, 0.7), (4, 0.0), (4, 1.5)):
        with pytest.raises(ConfigError, match="recency in"):
            EmbeddingRetrieval.of(model, recent, recency=recency)
        with pytest.raises(ConfigError, match="recency in"):
            TrainedRetrieval.load(run, RankerCatalogue("ml-1m", PARTIAL), recent,
                                  recency=recency)


def _served(run: Path, share: float, stage_weight: float = 0.0
            ) -> tuple[RelaySystem, TrainedRetrieval, dict[int, np.ndarray]]:
    """A one-instance cascade over ``run`` at run share ``share`` beside the item embeddings
    (no item-to-item channel: tests/cascade/test_item_cf.py), and the users' histories."""
    ranker = PARTIAL
    model = make_model(0, num_items=len(ranker), max_seq_len=256)
    histories = {u: h for u, h in _histories(ranker, seed=1).items()
                 if np.isin(ranker[h - 1], load_run(run)[3]).any()}
    store = InMemoryHistoryStore.from_sequences({u: (h, None) for u, h in histories.items()},
                                                num_items=len(ranker))
    config = SystemConfig(
        num_instances=1,
        stages=StagesConfig(retrieval_k=40, num_candidates=16, retrieval_history=RECENT,
                            retrieval_run_share=share, stage_weight=stage_weight,
                            retrieval_item_cf_rest_share=0.0,
                            retrieval_delay_ms=MEASURED_STAGE_DELAYS["retrieval_delay_ms"],
                            preprocess_delay_ms=MEASURED_STAGE_DELAYS["preprocess_delay_ms"]),
        instance=InstanceConfig(device_budget_bytes=8 << 20, host_budget_bytes=16 << 20,
                                page_tokens=16))
    stage = TrainedRetrieval.load(run, RankerCatalogue("ml-1m", ranker), RECENT,
                                  recency=config.stages.retrieval_recency)
    served = beside_the_default(stage, config.stages, model)    # as serve serves it
    return (RelaySystem(config, model, store, flops_cost_model(model.cfg), served), stage,
            histories)


def _recommend(system: RelaySystem, users: list[int]) -> list[Recommendation]:
    async def main() -> list[Recommendation]:
        await system.start()
        try:
            return [await system.recommend(Visit(u, num_candidates=16)) for u in users]
        finally:
            await system.stop()
    return asyncio.run(main())


def test_the_cascade_ranks_the_runs_proposals_and_waits_for_no_simulated_delay(
        run: Path) -> None:
    system, stage, histories = _served(run, share=1.0)      # the run alone
    assert system.stages.retrieval is stage
    users = list(histories)
    for user, rec in zip(users, _recommend(system, users), strict=True):
        want = brute_force(run, PARTIAL, histories[user], user, RECENT,
                           system.config.stages.retrieval_recency)
        proposed = stage.propose(histories[user], 40, user)
        want.check(proposed, 40)
        fresh = proposed[~np.isin(proposed, histories[user])][:16]  # pre-processing's filter
        assert rec.candidates.tolist() == fresh.tolist()
        assert rec.scores.shape == (len(fresh),)
        assert rec.stages is not None and rec.stages.delay_s == 0.0
        assert rec.stages.retrieval_s >= 0 and not rec.stages.replayed


def test_a_run_below_a_share_of_one_serves_beside_the_item_embeddings(run: Path) -> None:
    system, stage, histories = _served(run, share=0.25)
    served = system.stages.retrieval
    assert isinstance(served, InterleavedRetrieval)
    default, channel = served.channels
    assert channel is stage and isinstance(default, EmbeddingRetrieval)
    assert (default.recent_events, default.recency) == (RECENT, stage.recency)
    np.testing.assert_array_equal(served.shares, [0.75, 0.25])
    users = list(histories)
    alone = InterleavedRetrieval([(EmbeddingRetrieval.of(system.model, RECENT,
                                                         recency=stage.recency), 0.75),
                                  (stage, 0.25)])
    for user, rec in zip(users, _recommend(system, users), strict=True):
        proposed = alone.propose(histories[user], 40, user)
        fresh = proposed[~np.isin(proposed, histories[user])][:16]
        assert rec.candidates.tolist() == fresh.tolist()
    # two channels, two score scales: a weight that would fuse them is refused at start
    with pytest.raises(ConfigError, match="retrieval_run_share to 1"):
        _served(run, share=0.25, stage_weight=0.5)
    fused, alone_stage, _ = _served(run, share=1.0, stage_weight=0.5)   # the run alone fuses
    assert fused.stages.retrieval is alone_stage


def test_runs_of_another_catalogue_are_refused_by_name(run: Path) -> None:
    with pytest.raises(CatalogueMismatchError, match="trained on 'ml-1m', the ranker on 'x'"):
        TrainedRetrieval.load(run, RankerCatalogue("x", np.sort(MOVIES)), RECENT, recency=1.0)
    elsewhere = np.arange(1, 301, dtype=np.int64)      # same dataset name, other ids
    with pytest.raises(CatalogueMismatchError, match=r"knows \d+ of the ranker's 300 items"):
        TrainedRetrieval.load(run, RankerCatalogue("ml-1m", elsewhere), RECENT, recency=1.0)


def test_simulated_delays_are_waited_after_the_measured_retrieval_and_reported() -> None:
    model = make_model(0, num_items=60)
    history = np.arange(1, 20, dtype=np.int64)

    async def both() -> tuple[float, float, float, float]:
        loop = asyncio.get_running_loop()
        simulated = EarlierStages(EmbeddingRetrieval.of(model, 8, recency=1.0), 32, 0.030, 0.020,
                                  clock=loop.time)
        measured = EarlierStages(EmbeddingRetrieval.of(model, 8, recency=1.0), 32, 0.0, 0.0,
                                 clock=loop.time)
        try:
            a = (await simulated.run(history, 8)).timing
            b = (await measured.run(history, 8)).timing
        finally:
            simulated.shutdown()
            measured.shutdown()
        return a.retrieval_s, a.delay_s, b.retrieval_s, b.delay_s

    # measured on the loop's virtual clock: the retrieval thread's work takes no time there
    retrieval_a, delay_a, retrieval_b, delay_b = run_virtual(both())
    assert (retrieval_a, retrieval_b, delay_b) == (0.0, 0.0, 0.0)
    assert delay_a == pytest.approx(0.050, abs=1e-12)
