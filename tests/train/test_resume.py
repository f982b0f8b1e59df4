"""A run's life across stops: resumed, it continues exactly where its last finished epoch
ended; stopped before its first validation it holds no weights; a diverged epoch stops it before
that epoch is saved."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.errors import CheckpointError, TrainingDivergedError
from relaygr.train import Trainer, TrainProgress, load_trained
from tests.train.helpers import TINY, cyclic_sequences


def test_resume_continues_exactly(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=40)
    straight = Trainer(TINY, seqs, tmp_path / "a", dataset="d", seed=2, progress_bar=False,
                       log=lambda _: None)
    straight.fit()
    first = Trainer(TINY.with_(max_epochs=1), seqs, tmp_path / "b", dataset="d", seed=2,
                    progress_bar=False, log=lambda _: None)
    first.fit()
    with pytest.raises(CheckpointError, match="already holds a run"):
        Trainer(TINY, seqs, tmp_path / "b", dataset="d", seed=2, progress_bar=False).fit()
    with pytest.raises(CheckpointError, match="different config"):
        Trainer(TINY.with_(learning_rate=0.5), seqs, tmp_path / "b", dataset="d", seed=2,
                progress_bar=False).fit(resume=True)
    resumed = Trainer(TINY, seqs, tmp_path / "b", dataset="d", seed=2, progress_bar=False,
                      log=lambda _: None)
    result = resumed.fit(resume=True)
    assert result.progress.epoch == 2 and result.progress.step == straight_steps(straight)
    for (name, a), (_, b) in zip(straight.model.state_dict().items(),
                                 resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    moments = 0
    for pa, pb in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        a, b = straight.optimizer.state.get(pa, {}), resumed.optimizer.state.get(pb, {})
        assert set(a) == set(b)   # parameters without gradients (time_w here) have no state
        for key in a:
            assert torch.equal(a[key], b[key]), key
            moments += 1
    assert moments > 0
    assert [h["valid_ndcg@10"] for h in result.progress.history] == \
        [h["valid_ndcg@10"] for h in straight_history(straight)]


def test_a_run_stopped_in_its_first_epoch_holds_no_weights_and_resumes_from_the_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped before its first validation, a run has its config and id map but no weights:
    loading it for serving or evaluation is refused by name (not its untrained initial
    weights served), and --resume trains it from the first epoch, as a run never stopped."""
    seqs = cyclic_sequences(tmp_path, num_users=40)
    straight = Trainer(TINY, seqs, tmp_path / "a", dataset="d", seed=2, progress_bar=False,
                       log=lambda _: None)
    straight.fit()

    def stopped(self: Trainer, progress: TrainProgress) -> dict[str, float]:
        raise KeyboardInterrupt

    stopped_run = Trainer(TINY, seqs, tmp_path / "b", dataset="d", seed=2, progress_bar=False,
                          log=lambda _: None)
    monkeypatch.setattr(Trainer, "train_epoch", stopped)
    with pytest.raises(KeyboardInterrupt):
        stopped_run.fit()
    monkeypatch.undo()
    assert (tmp_path / "b" / "config.json").is_file()
    with pytest.raises(CheckpointError, match="no trained weights yet"):
        load_trained(tmp_path / "b")
    resumed = Trainer(TINY, seqs, tmp_path / "b", dataset="d", seed=2, progress_bar=False,
                      log=lambda _: None)
    result = resumed.fit(resume=True)
    assert result.progress.epoch == TINY.max_epochs
    for (name, a), (_, b) in zip(load_trained(tmp_path / "a").model.state_dict().items(),
                                 load_trained(tmp_path / "b").model.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_a_diverged_epoch_stops_training_and_keeps_the_last_finished_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN loss means NaN weights: the run stops, typed, before that epoch is saved, so
    the files hold the last finished epoch (what --resume continues from)."""
    seqs = cyclic_sequences(tmp_path, num_users=40)
    run = Trainer(TINY.with_(max_epochs=1), seqs, tmp_path / "r", dataset="d", seed=2,
                  progress_bar=False, log=lambda _: None)
    run.fit()
    saved = (tmp_path / "r" / "last" / "progress.json").read_text()
    trainer = Trainer(TINY.with_(max_epochs=2), seqs, tmp_path / "r", dataset="d", seed=2,
                      progress_bar=False, log=lambda _: None)
    monkeypatch.setattr(Trainer, "train_epoch",
                        lambda self, progress: {"loss": float("nan")})
    with pytest.raises(TrainingDivergedError, match="epoch 2: the training loss is nan"):
        trainer.fit(resume=True)
    assert (tmp_path / "r" / "last" / "progress.json").read_text() == saved


def straight_steps(trainer: Trainer) -> int:
    return int(np.ceil(len(trainer.data) / TINY.batch_size)) * TINY.max_epochs


def straight_history(trainer: Trainer) -> list[dict[str, float]]:
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
