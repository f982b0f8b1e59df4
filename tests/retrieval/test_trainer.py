"""Training on a tiny generated pair: determinism under a seed, learning, run directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from relaygr.errors import CheckpointError, ConfigError, TrainingDivergedError
from relaygr.retrieval.checkpoint import (
    RunInfo,
    load_seed,
    read_history,
    read_result,
    read_run_info,
    save_result,
    save_splits,
    write_run_info,
)
from relaygr.retrieval.config import PRESETS, SCCDRConfig
from relaygr.retrieval.data import load_pair
from relaygr.retrieval.encoders import SAGETower
from relaygr.retrieval.splits import DomainSplit, SplitKind, make_split
from relaygr.retrieval.trainer import RetrievalTrainer
from tests.retrieval.conftest import write_pair

SMALL = {"dim": 8, "batch_size": 128, "max_epochs": 3, "pool_size": 8, "inter_negatives": 4,
         "curriculum_epochs": 2, "learning_rate": 1e-2, "num_negatives": 32}


def _splits(root: Path) -> tuple[dict[str, DomainSplit], int]:
    pair = load_pair(write_pair(root, items=(150, 120)), "aa_bb")
    return {d.name: make_split(d, SplitKind.CVGAE, 0, 0.5) for d in pair.domains}, \
        pair.num_users


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_same_seed_same_weights(tmp_path: Path, name: str) -> None:
    splits, num_users = _splits(tmp_path)
    cfg = PRESETS[name].with_(**SMALL)
    a = RetrievalTrainer(cfg, splits, num_users, seed=7, progress_bar=False).fit()
    b = RetrievalTrainer(cfg, splits, num_users, seed=7, progress_bar=False).fit()
    for (k, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values(),
                           strict=True):
        assert torch.equal(va, vb), k
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    losses = [h["loss"]["match"] for h in a.history]
    assert losses[-1] < losses[0]
    assert set(a.history[0]["valid"]) == {"aa", "bb"}
    if name in ("sccdr", "mixed"):
        assert a.history[0]["loss"]["inter"] > 0 and a.history[0]["loss"]["intra"] > 0
    else:
        assert a.history[0]["loss"]["inter"] == 0 and a.history[0]["loss"]["intra"] == 0


def test_a_diverged_loss_stops_training_and_an_empty_validation_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN loss makes NaN weights, whose NaN scores used to read as hits; with no
    validation rows no epoch could be chosen, and the untrained weights were kept."""
    splits, num_users = _splits(tmp_path)
    trainer = RetrievalTrainer(PRESETS["single"].with_(**SMALL), splits, num_users, seed=7,
                               progress_bar=False)
    monkeypatch.setattr(trainer, "_epoch", lambda epoch: {"total": float("nan")})
    with pytest.raises(TrainingDivergedError, match="epoch 1: the training loss is nan"):
        trainer.fit()
    for share in (0.0, 1.0):
        with pytest.raises(ConfigError, match="valid_share must be in \\(0, 1\\)"):
            PRESETS["single"].with_(valid_share=share)


def test_partner_stop_gradient_keeps_inter_cl_out_of_the_partner_tower(tmp_path: Path) -> None:
    splits, num_users = _splits(tmp_path)
    cfg = PRESETS["sccdr"].with_(**SMALL)
    trainer = RetrievalTrainer(cfg, splits, num_users, seed=0, progress_bar=False)
    outs = {d: trainer.model.tower(d)() for d in splits}
    anchors = torch.arange(10)
    loss = trainer._inter(outs["aa"], "bb", outs["bb"], anchors, epoch=0)
    loss.backward()
    assert all(p.grad is None for p in trainer.model.tower("bb").parameters())
    assert cast(SAGETower, trainer.model.tower("aa").encoder).user_emb.weight.grad is not None


@pytest.mark.parametrize("option", ["none", "share_user_embedding", "partner_items", "bridges"])
def test_run_directory_round_trip(tmp_path: Path, option: str) -> None:
    splits, num_users = _splits(tmp_path)
    extra = {"bridges": False} if option == "none" else {option: True}
    cfg = PRESETS["sccdr"].with_(**SMALL, **extra)
    result = RetrievalTrainer(cfg, splits, num_users, seed=1, progress_bar=False).fit()
    run = tmp_path / "run"
    info = RunInfo("aa_bb", ("aa", "bb"), num_users, SplitKind.CVGAE, "sccdr", cfg, (1,), {})
    write_run_info(run, info)
    save_splits(run, 1, splits)
    save_result(run, 1, result)
    assert read_run_info(run) == info
    trained = load_seed(run, info, 1)
    for d in ("aa", "bb"):
        np.testing.assert_array_equal(trained.model.item_vectors(d), result.model.item_vectors(d))
        assert len(trained.model.item_vectors(d)) == splits[d].num_items   # own items only
        np.testing.assert_array_equal(trained.model.user_vectors(d), result.model.user_vectors(d))
        np.testing.assert_array_equal(trained.splits[d].test_negatives, splits[d].test_negatives)
    assert read_result(run, 1)["best_epoch"] == result.best_epoch
    assert len(read_history(run, 1)) == len(result.history)
    with pytest.raises(CheckpointError):
        read_result(run, 2)
    with pytest.raises(CheckpointError):
        read_run_info(tmp_path)


def test_a_bad_run_json_is_refused_naming_the_field(tmp_path: Path) -> None:
    cfg = PRESETS["sccdr"].with_(**SMALL)
    info = RunInfo("aa_bb", ("aa", "bb"), 10, SplitKind.CVGAE, "sccdr", cfg, (1,), {"x": 1})
    assert RunInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    changes: list[tuple[dict[str, Any], str]] = [
        ({"split": "holdout"}, "RunInfo.split"),
        ({"seeds": "one"}, "RunInfo.seeds"),
        ({"extra": 1}, "extra"),
        ({"config": {**cfg.to_dict(), "tau": 0.5}}, "tau")]
    for change, named in changes:
        with pytest.raises(CheckpointError, match=named):
            RunInfo.from_dict({**info.to_dict(), **change})
    with pytest.raises(CheckpointError, match="not a retrieval run"):
        RunInfo.from_dict({**info.to_dict(), "format": "something else"})
    with pytest.raises(CheckpointError, match="not a retrieval run"):
        RunInfo.from_dict([])   # type: ignore[arg-type]


def test_no_preset_links_catalogues_and_older_runs_read_as_unlinked() -> None:
    assert not any(p.bridges for p in PRESETS.values())     # an option, measured, not a default
    # a run.json written before the option existed was trained without links
    older = {k: v for k, v in PRESETS["sccdr"].to_dict().items() if k != "bridges"}
    assert SCCDRConfig.from_dict(older).bridges is False


@pytest.mark.parametrize(("schedule", "final_lr"), [("constant", 1e-2), ("cosine", 0.0)])
def test_learning_rate_schedule(tmp_path: Path, schedule: str, final_lr: float) -> None:
    splits, num_users = _splits(tmp_path)
    cfg = PRESETS["single"].with_(**SMALL, lr_schedule=schedule, patience=3)
    trainer = RetrievalTrainer(cfg, splits, num_users, seed=0, progress_bar=False)
    result = trainer.fit()
    assert len(result.history) == cfg.max_epochs
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(final_lr, abs=1e-12)


def test_embedding_l2_is_the_mean_squared_norm_of_the_rows_a_step_uses(tmp_path: Path) -> None:
    splits, num_users = _splits(tmp_path)
    cfg = PRESETS["single"].with_(**SMALL, embedding_l2=1e-3)
    trainer = RetrievalTrainer(cfg, splits, num_users, seed=0, progress_bar=False)
    encoder = cast(SAGETower, trainer.model.tower("aa").encoder)   # "single" is GraphSAGE
    with torch.no_grad():
        encoder.user_emb.weight.fill_(0.5)
        encoder.item_emb.weight.fill_(0.25)
    batch = torch.from_numpy(splits["aa"].train[:10])
    negatives = torch.arange(6)
    norm = trainer._embedding_norm("aa", batch, negatives)
    dim = cfg.dim
    expected = (10 * dim * 0.25 + 10 * dim * 0.0625 + 6 * dim * 0.0625) / 10
    assert float(norm) == pytest.approx(expected, rel=1e-6)
    out = trainer.model.tower("aa")()
    state = trainer.gen.get_state()
    with_l2 = trainer._matching("aa", out, batch)
    trainer.gen.set_state(state)
    without = RetrievalTrainer(cfg.with_(embedding_l2=0.0), splits, num_users, seed=0,
                               progress_bar=False)
    without.model.load_state_dict(trainer.model.state_dict())
    without.gen.set_state(state)
    plain = without._matching("aa", without.model.tower("aa")(), batch)
    drawn = torch.Generator().set_state(state)
    negs = torch.randint(0, splits["aa"].num_items, (cfg.num_negatives,), generator=drawn)
    # the same loss computed the same way, plus the term: one float32 rounding of the sum apart
    rounding = torch.finfo(torch.float32).eps * abs(float(with_l2))
    assert float(with_l2 - plain) == pytest.approx(
        1e-3 * float(trainer._embedding_norm("aa", batch, negs)), abs=rounding)
