"""``relaygr serve --retrieval-run HSTU_RUN --stage-weight W``: /v1/recommend serves the cascade
``relaygr eval --retrieval HSTU_RUN --stage-weight W`` measures. For each user, the answer holds
the items eval's cascade ranks for the same history, K and w (stage A's top K, ranked by B
against its cached prefix, fused with A's score) in the same order, on the cached path and on
the full pass alike; w = 0 is the ranker's order; mismatched stage runs are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from relaygr.cascade.config import MEASURED_STAGE_DELAYS
from relaygr.cascade.hstu_retrieval import HSTURunRetrieval
from relaygr.data import load_sequences
from relaygr.data.split import EvalCases
from relaygr.errors import ConfigError
from relaygr.server import ModelSource, RelayService, ServerConfig, build_embedded
from relaygr.server.build import load_model
from relaygr.train import Trainer, load_trained
from relaygr.train.evaluate import CascadeSpec, fuse, prefilled_batches, ranked_proposals
from relaygr.train.stage_runs import load_stage_run
from relaygr.train.stages import CheckpointRetrieval
from tests.engine.helpers import flops_cost_model
from tests.server.helpers import run_with_client, system_config
from tests.server.test_retrieval_run import serve_options
from tests.tolerance import reorder_tolerance
from tests.train.helpers import TINY, write_cyclic_udata

K = 40           # of 120 items; histories hold 8 to 14
WEIGHT = 0.75
USERS = 12
# eval's cascade for one user: its items best first (dataset ids), and their final, ranker and
# stage scores in that order
Offline = tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Stage A and ranker B: two runs of one tiny config on one generated log, seeds 0 and 1."""
    root = tmp_path_factory.mktemp("stage-fusion")
    write_cyclic_udata(root / "u.data", num_users=48)
    seqs = load_sequences("ml-100k", root)
    for name, seed in (("A", 0), ("B", 1)):
        Trainer(TINY.with_(max_epochs=1), seqs, root / name, dataset="ml-100k", seed=seed,
                progress_bar=False, log=lambda _: None).fit()
    return root / "A", root / "B"


def _service(runs: tuple[Path, Path], weight: float, mode: str = "relay") -> RelayService:
    stage, ranker = runs
    source = ModelSource(checkpoint=ranker, retrieval_run=stage)
    system = system_config(num_instances=1, mode=mode, stages={
        "retrieval_k": 64, "num_candidates": K, "stage_weight": weight, **MEASURED_STAGE_DELAYS})
    return build_embedded(source, system, ServerConfig(), flops_cost_model(load_model(source).cfg))


def _served(service: RelayService, users: list[int]) -> list[dict[str, Any]]:
    async def body(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post("/v1/recommend", json={"user_id": u, "num_candidates": K})
                for u in users]

    answers = run_with_client(service, body)
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [a.json() for a in answers]


def _offline(runs: tuple[Path, Path], users: list[int], weight: float
             ) -> dict[int, Offline]:
    """Eval's cascade for each user's whole history (``ranked_proposals`` and ``fuse``, what
    ``serving_ranks`` runs), in eval's batches, by dataset user (``Offline``)."""
    stage_dir, ranker_dir = runs
    ranker = load_trained(ranker_dir)
    seqs = load_sequences("ml-100k", stage_dir.parent, id_map=ranker.id_map)
    dense = {int(u): j for j, u in enumerate(seqs.user_ids)}
    rows = np.asarray([dense[u] for u in users])
    lengths = np.asarray([len(seqs.sequence(j)) for j in rows])
    cases = EvalCases(rows, lengths, np.ones(len(rows), dtype=np.int64))   # targets: unread
    stage = CheckpointRetrieval(load_stage_run(stage_dir, "cpu", ranker.id_map, None).model)
    cascade = CascadeSpec(stage, K, weight)
    items = np.asarray(ranker.id_map.items)
    out = {}
    for batch, window, prefixes in prefilled_batches(ranker.model, seqs, cases,
                                                     ranker.model.cfg.max_seq_len, False, 8,
                                                     False):
        proposals, ranked = ranked_proposals(ranker.model, cases, batch, window, prefixes,
                                             cascade)
        fused = fuse(proposals, ranked, weight)
        for j, row in enumerate(batch.tolist()):
            ids, stage_scores = proposals.row(j)
            order = torch.argsort(fused[j].float(), descending=True, stable=True)
            out[users[row]] = (items[ids[order].numpy() - 1].tolist(), fused[j].float()[order],
                               ranked[j].float()[order], stage_scores[order])
    return out


def _tolerance(offline: dict[int, Offline]) -> float:
    """How far serve's scores may be from eval's: eval prefills a batch of users, serve one
    (the stage) or its cached prefix (the ranker), so the reductions of each layer over up to
    ``max_seq_len`` events (or ``dim`` features) run in other orders; the terms of a score sum
    to about the largest score's magnitude (tests/tolerance.py)."""
    scale = max(float(torch.cat([v[1], v[2], v[3]]).abs().max()) for v in offline.values())
    return reorder_tolerance(terms=max(TINY.max_seq_len, TINY.dim), abs_sum=scale,
                             chained=TINY.num_layers + 1)


def _check_same(served: dict[str, object], offline: Offline, tol: float) -> None:
    """The same items, each with eval's scores up to ``tol``, in eval's order: read in eval's
    final scores, the served order descends, so two items come in either order only where eval
    scores them within rounding of each other (the lists are equal where no two are that
    close)."""
    items, fused, ranker, stage = offline
    candidates = served["candidates"]
    assert isinstance(candidates, list) and sorted(candidates) == sorted(items)
    at = {item: j for j, item in enumerate(items)}
    where = torch.tensor([at[item] for item in candidates])
    for field, want in (("scores", fused), ("ranker_scores", ranker), ("stage_scores", stage)):
        torch.testing.assert_close(torch.tensor(served[field]), want[where], atol=tol, rtol=0)
    in_eval = fused[where]
    assert (in_eval[1:] <= torch.cummin(in_eval, 0).values[:-1] + 2 * tol).all(), \
        (candidates, items)


@pytest.mark.parametrize("mode", ["relay", "baseline"])
def test_recommend_orders_as_evals_cascade_on_the_cached_and_the_full_path(
        runs: tuple[Path, Path], mode: str) -> None:
    service = _service(runs, WEIGHT, mode)
    assert isinstance(service.backend.system.stages.retrieval,  # type: ignore[attr-defined]
                      HSTURunRetrieval)
    users = sorted(service.backend.store)[:USERS]
    answers = _served(service, users)
    offline = _offline(runs, users, WEIGHT)
    tol = _tolerance(offline)
    for user, answer in zip(users, answers, strict=True):
        _check_same(answer, offline[user], tol)
        assert answer["stage_weight"] == WEIGHT and len(answer["candidates"]) == K
        t = answer["timings"]
        assert t["retrieval_ms"] > 0 and t["simulated_delay_ms"] == 0.0
    paths = {a["path"] for a in answers}
    # baseline recomputes every prefix; the relay ranks against the pre-inferred one
    assert paths == {"full"} if mode == "baseline" else "full" not in paths


def test_weight_zero_is_the_rankers_order_and_the_weight_changes_it(
        runs: tuple[Path, Path]) -> None:
    service = _service(runs, 0.0)
    users = sorted(service.backend.store)[:USERS]
    answers = _served(service, users)
    offline = _offline(runs, users, 0.0)
    fused = _offline(runs, users, WEIGHT)
    tol = _tolerance(offline)
    for user, answer in zip(users, answers, strict=True):
        _check_same(answer, offline[user], tol)
        assert answer["scores"] == answer["ranker_scores"]
        assert answer["ranker_scores"] == sorted(answer["ranker_scores"], reverse=True)
        assert answer["stage_weight"] == 0.0
        # the same K proposals either way: the weight reorders them, it does not choose them
        assert sorted(answer["candidates"]) == sorted(fused[user][0])
    # fusion moves the order, by more than rounding: the two orders are not equal up to ties
    moved = 0
    for user in users:
        at = {item: j for j, item in enumerate(offline[user][0])}
        ranker = offline[user][1][torch.tensor([at[item] for item in fused[user][0]])]
        moved += int((ranker[1:] > torch.cummin(ranker, 0).values[:-1] + 2 * tol).any())
    assert moved > 0


def _copy_run(run: Path, to: Path, file: str, edit: dict[str, object]) -> Path:
    shutil.copytree(run, to)
    data = json.loads((to / file).read_text())
    for key, value in edit.items():
        *path, last = key.split(".")
        node = data
        for part in path:
            node = node[part]
        node[last] = value
    (to / file).write_text(json.dumps(data))
    return to


def test_serve_refuses_a_stage_run_that_does_not_fit_the_ranker(
        runs: tuple[Path, Path], tmp_path: Path) -> None:
    stage, ranker = runs
    items = json.loads((stage / "id_map.json").read_text())["items"]
    other = _copy_run(stage, tmp_path / "other-items", "id_map.json",
                      {"items": [*items[:-1], 10**6]})
    timed = _copy_run(stage, tmp_path / "timed", "config.json", {"train.use_timestamps": True})
    neither = tmp_path / "neither"
    neither.mkdir()
    refusals = ((other, "numbers items differently"), (timed, "must be position-only"),
                (neither, "neither an HSTU training run"),
                (tmp_path / "missing", "is not a directory"))
    for run, message in refusals:
        with pytest.raises(ConfigError, match=message):
            _service((run, ranker), WEIGHT)


def test_serve_flag_sets_the_stage_weight(tmp_path: Path) -> None:
    options = serve_options("--checkpoint", str(tmp_path), "--stage-weight", "0.75")
    assert options.system.stages.stage_weight == 0.75
    assert serve_options("--checkpoint", str(tmp_path)).system.stages.stage_weight == 0.0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="stage_weight must be finite and >= 0"):
            serve_options("--checkpoint", str(tmp_path), "--stage-weight", bad)
