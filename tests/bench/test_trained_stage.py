"""The benchmark with a trained retrieval stage: the ML-1M replay retrieves live through it, on
the request's path, with no simulated stage delay and no precomputed book."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from relaygr.bench.protocol import RunClock, SystemContext
from relaygr.bench.systems import CascadeUnderTest, SharedParts, mode_factories
from relaygr.bench.workload.ml1m import ML1MConfig, ML1MWorkload, read_movie_ids
from relaygr.cascade.config import StagesConfig, SystemConfig
from relaygr.cascade.proposals import EmbeddingRetrieval
from relaygr.cascade.trained_retrieval import RankerCatalogue, TrainedRetrieval
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.engine.instance import InstanceConfig
from tests.cascade.retrieval_runs import MOVIES, train_run, write_ratings
from tests.engine.helpers import flops_cost_model
from tests.model.helpers import make_model


def test_the_ml1m_replay_retrieves_live_through_the_trained_stage(tmp_path: Path) -> None:
    ratings = write_ratings(tmp_path / "ml")
    run = train_run(tmp_path / "ml", tmp_path / "run")
    workload = ML1MWorkload(ML1MConfig(path=ratings, visits_per_user=1, events_per_visit=2,
                                       min_prefix_tokens=4, num_candidates=8)
                            ).build(qps=20.0, num_requests=6)
    movies = read_movie_ids(ratings)
    assert set(movies.tolist()) <= set(MOVIES.tolist())
    recency = StagesConfig().retrieval_recency          # the system's below
    stage = TrainedRetrieval.load(run, RankerCatalogue("ml-1m", movies), 6, recency=recency)
    model = make_model(0, num_items=workload.num_items, max_seq_len=256)
    parts = SharedParts(model, flops_cost_model(model.cfg),
                        EmbeddingRetrieval.of(model, 6, recency=recency), measured={"ml1m": stage})
    base = SystemConfig(num_instances=1,
                        stages=StagesConfig(num_candidates=8, retrieval_k=32,
                                            retrieval_history=6),
                        instance=InstanceConfig(device_budget_bytes=8 << 20,
                                                host_budget_bytes=16 << 20, page_tokens=16))
    cut = mode_factories(["relay"], base, parts)["relay"](SystemContext(workload, RunClock()))
    assert isinstance(cut, CascadeUnderTest)
    system = cut.system
    assert system.stages.book is None and system.stages.retrieval is stage
    stages = system.config.stages
    assert (stages.retrieval_delay_ms, stages.preprocess_delay_ms) == (0, 0)
    assert workload.stage_delays.total_s > 0          # what the replay would otherwise wait

    async def main() -> list[tuple[np.ndarray, Recommendation]]:
        await cut.start()
        try:
            out = []
            for r in workload.requests:
                seen = np.concatenate([system.store.get(r.user_id).items,
                                       np.asarray(r.recent_items, dtype=np.int64)])
                out.append((seen, await system.recommend(Visit(
                    r.user_id, r.recent_items, r.recent_timestamps, r.request_ts, 8))))
            return out
        finally:
            await cut.stop()

    for (seen, rec), request in zip(asyncio.run(main()), workload.requests, strict=True):
        proposed = stage.propose(seen, 32, request.user_id)
        assert rec.candidates.tolist() == proposed[~np.isin(proposed, seen)][:8].tolist()
        assert rec.stages is not None and rec.stages.delay_s == 0.0
        assert not rec.stages.replayed
    assert (system.stages.retrieved, system.stages.replayed) == (len(workload.requests), 0)
