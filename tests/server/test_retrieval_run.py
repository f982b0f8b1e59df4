"""``relaygr serve --retrieval-run``: a trained retrieval run serves /v1/recommend's retrieval,
the simulated stage delays default to 0, and every answer says where its time went."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import numpy as np
import pytest

from relaygr.cascade.config import MEASURED_STAGE_DELAYS, StagesConfig
from relaygr.cascade.eventlog import EventLog
from relaygr.cascade.item_cf import ItemCFRetrieval
from relaygr.cascade.proposals import EmbeddingRetrieval, InterleavedRetrieval
from relaygr.cascade.trained_retrieval import TrainedRetrieval
from relaygr.cli import serve
from relaygr.data import load_sequences
from relaygr.errors import CatalogueMismatchError, ConfigError
from relaygr.server import ModelSource, RelayService, ServerConfig, build, build_embedded
from relaygr.server.build import load_model
from relaygr.server.config import ServeOptions
from relaygr.train import Trainer
from tests.cascade.retrieval_runs import brute_force, train_run, write_ratings
from tests.engine.helpers import flops_cost_model
from tests.server.helpers import make_service, run_with_client, system_config
from tests.server.test_cli import parse
from tests.train.helpers import TINY


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A ranking checkpoint and a retrieval run, both trained on one generated ML-1M file."""
    root = tmp_path_factory.mktemp("serve-retrieval")
    ratings = write_ratings(root / "ml")
    seqs = load_sequences("ml-1m", ratings)
    Trainer(TINY.with_(max_epochs=1), seqs, root / "rank", dataset="ml-1m",
            progress_bar=False, log=lambda _: None).fit()
    return root / "rank", train_run(root / "ml", root / "retrieval")


def _service(rank: Path, retrieval: Path, share: float = 1.0) -> RelayService:
    source = ModelSource(checkpoint=rank, retrieval_run=retrieval)
    model = load_model(source)
    system = system_config(num_instances=1, stages={
        "retrieval_history": 6, "retrieval_run_share": share, **MEASURED_STAGE_DELAYS})
    return build_embedded(source, system, ServerConfig(), flops_cost_model(model.cfg))


def test_by_default_the_run_serves_its_share_beside_the_item_embeddings(
        runs: tuple[Path, Path]) -> None:
    """Three channels by default: the item embeddings, the run's towers and the item-to-item
    channel of the run's training interactions, in the configured shares."""
    service = _service(*runs, share=StagesConfig.retrieval_run_share)
    stage = service.backend.system.stages.retrieval          # type: ignore[attr-defined]
    assert isinstance(stage, InterleavedRetrieval)
    default, run, item_cf = stage.channels
    assert isinstance(default, EmbeddingRetrieval) and isinstance(run, TrainedRetrieval)
    assert isinstance(item_cf, ItemCFRetrieval)
    np.testing.assert_allclose(stage.shares, StagesConfig().retrieval_shares)
    assert stage.shares[1] == StagesConfig.retrieval_run_share


def test_recommend_serves_the_runs_top_k_with_per_stage_timings(runs: tuple[Path, Path]
                                                               ) -> None:
    rank, retrieval = runs
    service = _service(rank, retrieval)                      # the run alone: its exact top-k
    stage = service.backend.system.stages.retrieval          # type: ignore[attr-defined]
    assert isinstance(stage, TrainedRetrieval)
    users = sorted(service.backend.store)[:6]
    ranker = np.asarray(service.catalog.id_map.items)        # type: ignore[union-attr]
    histories = {u: service.backend.store.get(u).items.copy() for u in users}

    async def body(client: httpx.AsyncClient) -> list[httpx.Response]:
        out = [await client.post("/v1/recommend", json={"user_id": u}) for u in users]
        out.append(await client.post("/v1/rank", json={"user_id": users[0],
                                                       "candidates": [int(ranker[0])]}))
        return out

    *answers, ranked = run_with_client(service, body)
    for user, answer in zip(users, answers, strict=True):
        assert answer.status_code == 200, answer.text
        body_ = answer.json()
        history = histories[user]
        proposed = stage.propose(history, 64, user)
        brute_force(retrieval, ranker, history, user, 6,
                    StagesConfig().retrieval_recency).check(proposed, 64)
        fresh = proposed[~np.isin(proposed, history)][:16]      # pre-processing's filter
        # the ranked proposals, best first, in the API's ids
        assert sorted(body_["candidates"]) == sorted(ranker[fresh - 1].tolist())
        assert body_["scores"] == sorted(body_["scores"], reverse=True)
        t = body_["timings"]
        assert t["simulated_delay_ms"] == 0.0 and t["retrieval_ms"] >= 0
        assert t["retrieval_ms"] + t["simulated_delay_ms"] + t["ranking_ms"] <= t["total_ms"]
        assert (t["ranking_ms"], t["total_ms"]) == (body_["ranking_ms"], body_["total_ms"])
    metrics = service.metrics.render().decode()
    assert 'relaygr_stage_seconds_count{endpoint="recommend",stage="retrieval"} 6.0' in metrics
    assert ranked.status_code == 200, ranked.text
    timings = ranked.json()["timings"]
    assert timings["retrieval_ms"] is None and timings["simulated_delay_ms"] is None
    assert timings["ranking_ms"] <= timings["total_ms"]


def test_serve_flag_defaults_the_simulated_delays_to_zero(tmp_path: Path) -> None:
    options = serve_options("--checkpoint", str(tmp_path), "--retrieval-run", str(tmp_path))
    stages = options.system.stages
    assert (stages.retrieval_delay_ms, stages.preprocess_delay_ms) == (0, 0)
    assert options.model.retrieval_run == tmp_path
    path = tmp_path / "system.json"
    path.write_text(json.dumps({"stages": {"preprocess_delay_ms": 7.0}}))     # asked for: kept
    kept = serve_options("--checkpoint", str(tmp_path), "--retrieval-run", str(tmp_path),
                         "--system-config", str(path))
    assert (kept.system.stages.retrieval_delay_ms, kept.system.stages.preprocess_delay_ms) \
        == (0, 7.0)
    plain = serve_options("--checkpoint", str(tmp_path))
    assert plain.system.stages.delay_s > 0          # without a trained stage: simulated
    with pytest.raises(ConfigError, match="needs --checkpoint"):
        serve_options("--retrieval-run", str(tmp_path))
    assert options.system.stages.retrieval_run_share == StagesConfig.retrieval_run_share
    alone = serve_options("--checkpoint", str(tmp_path), "--retrieval-run", str(tmp_path),
                          "--retrieval-run-share", "1")
    assert alone.system.stages.retrieval_run_share == 1.0
    with pytest.raises(ConfigError, match="share of a `relaygr train-retrieval`"):
        serve_options("--checkpoint", str(tmp_path), "--retrieval-run-share", "0.5")
    hstu = tmp_path / "hstu"                     # an HSTU run's retrieval head serves alone
    hstu.mkdir()
    (hstu / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="serves alone"):
        serve_options("--checkpoint", str(tmp_path), "--retrieval-run", str(hstu),
                      "--retrieval-run-share", "0.5")
    with pytest.raises(ConfigError, match="retrieval_run_share must be in"):
        serve_options("--checkpoint", str(tmp_path), "--retrieval-run", str(tmp_path),
                      "--retrieval-run-share", "0")
    # the run's item-to-item channel: a share of the list beside it, only with such a run
    three = serve_options("--checkpoint", str(tmp_path), "--retrieval-run", str(tmp_path),
                          "--retrieval-run-share", "0.4", "--retrieval-item-cf-rest-share",
                          "0.25")
    assert three.system.stages.retrieval_shares == pytest.approx((0.45, 0.4, 0.15))
    assert options.system.stages.retrieval_item_cf_rest_share \
        == StagesConfig.retrieval_item_cf_rest_share
    for argv in (("--retrieval-item-cf-rest-share", "0.3"),
                 ("--retrieval-run", str(hstu), "--retrieval-item-cf-rest-share", "0.3")):
        with pytest.raises(ConfigError, match="item-to-item channel of a `relaygr"):
            serve_options("--checkpoint", str(tmp_path), *argv)
    with pytest.raises(ConfigError, match="leaves no share to --retrieval-item-cf-rest-share"):
        serve_options("--checkpoint", str(tmp_path), "--retrieval-run", str(tmp_path),
                      "--retrieval-run-share", "1", "--retrieval-item-cf-rest-share", "0.5")
    with pytest.raises(ConfigError, match="retrieval_item_cf_rest_share must be in"):
        serve_options("--checkpoint", str(tmp_path), "--retrieval-run", str(tmp_path),
                      "--retrieval-item-cf-rest-share", "1.5")


def serve_options(*argv: str) -> ServeOptions:
    return serve.options_from_args(parse(*argv, "--device", "cpu"))


def test_a_run_of_another_dataset_is_refused(runs: tuple[Path, Path], tmp_path: Path) -> None:
    rank, retrieval = runs
    info = json.loads((retrieval / "run.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    for item in retrieval.iterdir():
        if item.name != "run.json":
            (other / item.name).symlink_to(item)
    (other / "run.json").write_text(json.dumps({**info, "pair": "ml-100k"}))
    with pytest.raises(CatalogueMismatchError, match="trained on 'ml-100k', the ranker on"):
        _service(rank, other)


def test_without_a_trained_stage_the_configured_delays_are_waited_and_reported() -> None:
    # retrieval_delay_ms=3 + preprocess_delay_ms=2: the earlier stages end no sooner than 5 ms
    # after the request arrived (their fleets start with it, beside the pre-infer signal; asyncio
    # may fire a timer up to its clock resolution early)
    service = make_service(system_config(stages={"retrieval_delay_ms": 3,
                                                 "preprocess_delay_ms": 2}))
    user = sorted(service.backend.store)[0]

    async def body(client: httpx.AsyncClient) -> tuple[httpx.Response, dict[str, Any]]:
        return (await client.post("/v1/recommend", json={"user_id": user}),
                (await client.get("/openapi.json")).json())

    answer, openapi = run_with_client(service, body)
    described = openapi["paths"]["/v1/recommend"]["post"]["description"]
    assert "50 ms by default" in described and "simulated_delay_ms" in described
    assert answer.status_code == 200, answer.text
    t = answer.json()["timings"]
    resolution_ms = 1e3 * time.get_clock_info("monotonic").resolution
    assert t["total_ms"] - t["ranking_ms"] >= 5.0 - resolution_ms
    assert t["retrieval_ms"] + t["simulated_delay_ms"] <= t["total_ms"] - t["ranking_ms"]
    assert t["retrieval_ms"] + t["simulated_delay_ms"] + t["ranking_ms"] <= t["total_ms"]


def test_a_bad_run_is_refused_before_the_users_load_and_the_event_log_opens(
        runs: tuple[Path, Path], tmp_path: Path) -> None:
    rank, _ = runs
    neither = tmp_path / "neither"          # neither kind of run: refused when it loads
    neither.mkdir()
    events = tmp_path / "events.sqlite"
    source = ModelSource(checkpoint=rank, retrieval_run=neither, events=events)
    with mock.patch.object(build, "load_store", side_effect=AssertionError("users loaded")), \
            pytest.raises(ConfigError, match="neither"):
        build_embedded(source, system_config(num_instances=1), ServerConfig(),
                       flops_cost_model(load_model(source).cfg))
    assert not events.exists()


def test_a_start_up_that_fails_after_the_event_log_opened_lets_it_go(
        runs: tuple[Path, Path], tmp_path: Path) -> None:
    rank, retrieval = runs
    events = tmp_path / "events.sqlite"
    source = ModelSource(checkpoint=rank, retrieval_run=retrieval, events=events)
    with mock.patch.object(build, "load_catalog", side_effect=ConfigError("no catalogue")), \
            pytest.raises(ConfigError, match="no catalogue"):
        build_embedded(source, system_config(num_instances=1), ServerConfig(),
                       flops_cost_model(load_model(source).cfg))
    assert events.exists()
    EventLog(events).close()                # not held: the failed start let it go
