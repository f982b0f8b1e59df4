"""The training schedule: the learning rate on a plateau and along a cosine, early stopping,
and which epochs are validated."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaygr.errors import ConfigError
from relaygr.train import RankingMetrics, Trainer
from relaygr.train.trainer import cosine_factor
from tests.train.helpers import TINY, cyclic_sequences


def test_learning_rate_halves_on_a_plateau_and_early_stopping_counts(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=16)
    config = TINY.with_(lr_decay=0.5, lr_decay_patience=2, patience=3)
    trainer = Trainer(config, seqs, tmp_path / "run", dataset="d", progress_bar=False)
    progress = trainer._start(resume=False)
    losses = {"loss": 1.0, "retrieval": 1.0, "ranking": 0.0}

    def validate(ndcg: float) -> None:
        metrics = RankingMetrics(hr={10: 0.0, 50: 0.0, 200: 0.0},
                                 ndcg={10: ndcg, 50: 0.0, 200: 0.0}, mrr=0.0, num_cases=1)
        progress.epoch += 1
        trainer._after_validation(progress, metrics, losses)

    lrs = []
    for ndcg in (0.3, 0.2, 0.2, 0.4, 0.1, 0.1, 0.1):
        validate(ndcg)
        lrs.append(trainer.optimizer.param_groups[0]["lr"] / config.learning_rate)
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert (progress.best_ndcg, progress.best_epoch, progress.evals_since_best) == (0.4, 4, 3)
    assert trainer._stop_reason(progress, 0.0).startswith("early stop")
    assert [h["lr"] for h in progress.history][:4] == [config.learning_rate] * 3 + \
        [config.learning_rate / 2]


def test_the_last_epoch_is_validated_when_the_schedule_ends_between_validations(
        tmp_path: Path) -> None:
    # 3 epochs, a validation every 2nd: epoch 3 ends the run and must be validated too, else
    # its training is lost (and a run shorter than one validation period kept its initial
    # weights as the "best").
    seqs = cyclic_sequences(tmp_path, num_users=16)
    trainer = Trainer(TINY.with_(max_epochs=3, eval_every_epochs=2), seqs, tmp_path / "run",
                      dataset="d", progress_bar=False)
    result = trainer.fit()
    assert [h["epoch"] for h in result.progress.history] == [2, 3]
    once = Trainer(TINY.with_(max_epochs=1, eval_every_epochs=2), seqs, tmp_path / "once",
                   dataset="d", progress_bar=False).fit()
    assert [h["epoch"] for h in once.progress.history] == [1]
    assert once.progress.best_epoch == 1


def test_cosine_schedule_decays_per_step_to_its_floor(tmp_path: Path) -> None:
    assert cosine_factor(0, 10, 0.1) == 1.0
    assert cosine_factor(5, 10, 0.1) == pytest.approx(0.55)
    assert cosine_factor(10, 10, 0.1) == cosine_factor(99, 10, 0.1) == pytest.approx(0.1)
    seqs = cyclic_sequences(tmp_path, num_users=32)
    config = TINY.with_(lr_schedule="cosine", lr_min_ratio=0.0, max_epochs=2)
    trainer = Trainer(config, seqs, tmp_path / "run", dataset="d", progress_bar=False)
    progress = trainer._start(resume=False)
    trainer.train_epoch(progress)          # half the schedule: the last step ran below 1/2
    steps = progress.step
    last_lr = trainer.optimizer.param_groups[0]["lr"]
    expected = config.learning_rate * cosine_factor(steps - 1, 2 * steps, 0.0)
    assert last_lr == pytest.approx(expected) and last_lr > config.learning_rate / 2
    with pytest.raises(ConfigError):
        TINY.with_(lr_schedule="linear")
