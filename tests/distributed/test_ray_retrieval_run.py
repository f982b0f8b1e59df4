"""``relaygr serve --ray --retrieval-run RUN --stage-weight W``: the Ray ingress serves the
trained retrieval stage the embedded server serves, for both kinds of run.

The ranker and both stages (another HSTU run's retrieval head; a ``relaygr train-retrieval``
run's towers) are trained here on one generated ML-1M log. Without a cluster: the application
is built from the run directory and a run that does not fit is refused with the embedded
server's very error, by the driver and by the ingress alike; an ingress built in process
(``ingress_service`` over ``LocalRanker``'s real replicas) loads the run's stage and answers
/v1/recommend as the embedded service does. On a local Ray cluster (``ray``): the same answers
through Serve's HTTP proxy, with the stage's measured time in ``timings``.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from relaygr.cascade.config import MEASURED_STAGE_DELAYS, SystemConfig
from relaygr.cascade.hstu_retrieval import HSTURunRetrieval
from relaygr.cascade.item_cf import ItemCFRetrieval
from relaygr.cascade.proposals import InterleavedRetrieval
from relaygr.cascade.trained_retrieval import TrainedRetrieval
from relaygr.data import load_sequences
from relaygr.distributed.app import (
    IngressSpec,
    RayAppSpec,
    build_application,
    ingress_service,
)
from relaygr.errors import CatalogueMismatchError, ConfigError, RelayGRError
from relaygr.model.digest import model_digest
from relaygr.retrieval.checkpoint import read_run_info
from relaygr.server import ModelSource, RelayService, ServerConfig, build_embedded
from relaygr.server.build import load_model
from relaygr.train import Trainer
from tests.cascade.retrieval_runs import train_run, write_ratings
from tests.distributed.helpers import LocalRanker
from tests.engine.helpers import flops_cost_model
from tests.server.helpers import run_with_client, system_config
from tests.server.test_retrieval_run import serve_options
from tests.server.test_stage_fusion import _check_same, _copy_run
from tests.tolerance import reorder_tolerance
from tests.train.helpers import TINY

K = 16
WEIGHT = 0.75
USERS = 8
STAGES = {"hstu": HSTURunRetrieval, "towers": TrainedRetrieval}
# the towers' run alone (a share of 1), so that the stage weight fuses one scale
SYSTEM = system_config(num_instances=1, stages={
    "retrieval_k": 64, "num_candidates": K, "stage_weight": WEIGHT, "retrieval_run_share": 1.0,
    **MEASURED_STAGE_DELAYS})
Answer = dict[str, Any]


@dataclass(frozen=True)
class Runs:
    ranker: Path
    hstu: Path       # a `relaygr train` run of the same log (another seed)
    towers: Path     # a `relaygr train-retrieval` run of the same log

    def source(self, stage: str | Path) -> ModelSource:
        run = getattr(self, stage) if isinstance(stage, str) else stage
        return ModelSource(checkpoint=self.ranker, retrieval_run=run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("ray-retrieval")
    seqs = load_sequences("ml-1m", write_ratings(root / "ml"))
    for name, seed in (("hstu", 0), ("ranker", 1)):
        Trainer(TINY.with_(max_epochs=1), seqs, root / name, dataset="ml-1m", seed=seed,
                progress_bar=False, log=lambda _: None).fit()
    return Runs(root / "ranker", root / "hstu", train_run(root / "ml", root / "towers"))


def _embedded(source: ModelSource, system: SystemConfig = SYSTEM) -> RelayService:
    return build_embedded(source, system, ServerConfig(),
                          flops_cost_model(load_model(source).cfg))


def _ingress_spec(source: ModelSource, system: SystemConfig = SYSTEM) -> IngressSpec:
    return IngressSpec(source, model_digest(load_model(source)), system, ServerConfig())


def _answers(service: RelayService, users: list[int]) -> list[Answer]:
    async def body(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post("/v1/recommend", json={"user_id": u}) for u in users]

    out = run_with_client(service, body)
    assert all(r.status_code == 200 for r in out), [r.text for r in out]
    return [r.json() for r in out]


def _tolerance(runs: Runs, answers: list[Answer]) -> float:
    """How far two processes' scores may differ (tests/tolerance.py): the same functions of the
    same inputs, only their reductions possibly split otherwise (thread counts). The longest is
    over the ranker's window, its width or the towers' recent events; the deepest chain the
    ranker's layers or the towers', then the score; terms sum to about the largest score."""
    towers = read_run_info(runs.towers).config
    scale = max(abs(s) for a in answers
                for s in (*a["scores"], *a["ranker_scores"], *a["stage_scores"]))
    return reorder_tolerance(terms=max(TINY.max_seq_len, TINY.dim, SYSTEM.stages.retrieval_history),
                             abs_sum=scale, chained=max(TINY.num_layers, towers.num_layers) + 1)


def _check_as_embedded(got: list[Answer], want: list[Answer], tol: float) -> None:
    """Each answer holds the embedded one's items with its scores (ranker, stage, fused) up to
    ``tol``, in its order wherever two fused scores are further apart than that; the stage's
    time was measured on the request's path and no delay was simulated."""
    for g, w in zip(got, want, strict=True):
        assert g["user_id"] == w["user_id"] and g["stage_weight"] == WEIGHT
        _check_same(g, (w["candidates"], torch.tensor(w["scores"]),
                        torch.tensor(w["ranker_scores"]), torch.tensor(w["stage_scores"])), tol)
        t = g["timings"]
        assert t["retrieval_ms"] > 0 and t["simulated_delay_ms"] == 0.0
        assert t["retrieval_ms"] + t["simulated_delay_ms"] + t["ranking_ms"] <= t["total_ms"]


@pytest.mark.parametrize("stage", STAGES)
def test_an_ingress_loads_the_runs_stage_and_answers_as_embedded(runs: Runs,
                                                                  stage: str) -> None:
    source = runs.source(stage)
    assert build_application(RayAppSpec(source, SYSTEM, ServerConfig(), replicas=1))
    service = ingress_service(LocalRanker(["replica-a"], system=SYSTEM, source=source),
                              _ingress_spec(source))
    assert isinstance(service.backend.stages.retrieval,  # type: ignore[attr-defined]
                      STAGES[stage])
    embedded = _embedded(source)
    users = sorted(embedded.backend.store)[:USERS]
    want = _answers(embedded, users)
    _check_as_embedded(_answers(service, users), want, _tolerance(runs, want))


def test_an_ingress_serves_the_towers_beside_the_item_embeddings_as_embedded(runs: Runs
                                                                            ) -> None:
    """At a share below 1 (no stage weight) the ingress interleaves the towers with the
    checkpoint's item embeddings and the run's item-to-item channel, as the embedded server
    does: the same candidates and scores."""
    beside = SYSTEM.with_(stages={"stage_weight": 0.0, "retrieval_run_share": 0.5})
    source = runs.source("towers")
    service = ingress_service(LocalRanker(["replica-a"], system=beside, source=source),
                              _ingress_spec(source, beside))
    stage = service.backend.stages.retrieval                 # type: ignore[attr-defined]
    assert isinstance(stage, InterleavedRetrieval)
    assert isinstance(stage.channels[1], TrainedRetrieval)
    assert isinstance(stage.channels[2], ItemCFRetrieval)
    embedded = _embedded(source, beside)
    users = sorted(embedded.backend.store)[:USERS]
    want = _answers(embedded, users)
    tol = _tolerance(runs, want)
    for got, w in zip(_answers(service, users), want, strict=True):
        assert got["stage_weight"] == 0.0
        _check_same(got, (w["candidates"], torch.tensor(w["scores"]),
                          torch.tensor(w["ranker_scores"]), torch.tensor(w["stage_scores"])),
                    tol)


def _other_pair(towers: Path, to: Path) -> Path:
    """``towers`` as if trained on ML-100K (its files linked, ``run.json`` edited)."""
    to.mkdir()
    for item in towers.iterdir():
        if item.name != "run.json":
            (to / item.name).symlink_to(item)
    info = json.loads((towers / "run.json").read_text())
    (to / "run.json").write_text(json.dumps({**info, "pair": "ml-100k"}))
    return to


def _builds(source: ModelSource, system: SystemConfig = SYSTEM) -> list[Callable[[], object]]:
    """The embedded service, the Ray application (the driver) and an ingress replica."""
    return [lambda: _embedded(source, system),
            lambda: build_application(RayAppSpec(source, system, ServerConfig(), replicas=1)),
            lambda: ingress_service(None, _ingress_spec(source, system))]


def test_a_run_that_does_not_fit_is_refused_as_embedded(runs: Runs, tmp_path: Path) -> None:
    items = json.loads((runs.hstu / "id_map.json").read_text())["items"]
    (tmp_path / "neither").mkdir()
    refusals: list[tuple[Path, type[RelayGRError], str]] = [
        (_copy_run(runs.hstu, tmp_path / "other-items", "id_map.json",
                   {"items": [*items[:-1], 10**6]}), ConfigError, "numbers items differently"),
        (_other_pair(runs.towers, tmp_path / "other-pair"), CatalogueMismatchError,
         "trained on 'ml-100k'"),
        (tmp_path / "neither", ConfigError, "neither an HSTU training run"),
        (tmp_path / "missing", ConfigError, "is not a directory"),
    ]
    for run, error, message in refusals:
        said = set()
        for build in _builds(runs.source(run)):
            with pytest.raises(error, match=message) as refused:
                build()
            said.add((type(refused.value), str(refused.value)))
        assert len(said) == 1, said       # the same type and words from all three
    # the towers beside the item embeddings (a share below 1): no stage weight fuses two scales
    beside = SYSTEM.with_(stages={"retrieval_run_share": 0.5})
    words = set()
    for build in _builds(runs.source("towers"), beside):
        with pytest.raises(ConfigError, match="retrieval_run_share to 1") as refused:
            build()
        words.add(str(refused.value))
    assert len(words) == 1, words


def test_serve_ray_takes_a_retrieval_run_and_a_stage_weight(tmp_path: Path) -> None:
    options = serve_options("--ray", "--checkpoint", str(tmp_path), "--retrieval-run",
                            str(tmp_path), "--stage-weight", "0.5")
    assert options.ray and options.model.retrieval_run == tmp_path
    assert options.system.stages.stage_weight == 0.5
    stages = options.system.stages
    assert (stages.retrieval_delay_ms, stages.preprocess_delay_ms) == (0, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.ray
def test_recommend_under_ray_answers_as_the_embedded_service(runs: Runs) -> None:
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.serve.config import HTTPOptions

    from relaygr.distributed.app import init_ray

    init_ray(num_cpus=2)
    port = _free_port()
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
        for stage in STAGES:       # one application at a time: both fit the 2 CPUs in turn
            source = runs.source(stage)
            embedded = _embedded(source)
            users = sorted(embedded.backend.store)[:USERS]
            want = _answers(embedded, users)
            spec = RayAppSpec(source, SYSTEM, ServerConfig(), replicas=1, replica_cpus=0.5,
                              ingress_cpus=0.5,
                              cost_model=flops_cost_model(load_model(source).cfg).to_dict(),
                              torch_threads=1)
            serve.run(build_application(spec), name="relaygr", route_prefix="/")
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                answers = [client.post("/v1/recommend", json={"user_id": u}) for u in users]
            serve.delete("relaygr")
            assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
            got = [r.json() for r in answers]
            _check_as_embedded(got, want, _tolerance(runs, want))
            same = sum(g["candidates"] == w["candidates"] for g, w in zip(got, want, strict=True))
            print(f"\n[ray {stage}] {same}/{len(users)} answers in the embedded order; "
                  f"retrieval_ms {[round(g['timings']['retrieval_ms'], 2) for g in got]}")
    finally:
        serve.shutdown()
        ray.shutdown()
