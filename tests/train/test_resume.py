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
from relaygr.model import HSTU
from relaygr.train import Trainer, TrainProgress, checkpoint, load_trained
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
    with pytest.raises(CheckpointError, match=r"different config.*train\.learning_rate: "
                                              r"trained 0\.01, now 0\.5"):
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


PHASED = TINY.with_(rank_phase_epochs=1, rank_phase_users=16)


def _records(run: Path) -> list[dict[str, object]]:
    """``metrics.jsonl`` without the wall times (the rest is bit-for-bit reproducible)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


def _same_weights(a: Path, b: Path) -> None:
    for (name, x), (_, y) in zip(load_trained(a).model.state_dict().items(),
                                 load_trained(b).model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_a_run_resumed_with_more_epochs_after_its_ranking_phase_ends_as_the_longer_run(
        tmp_path: Path) -> None:
    """The phase changes nothing the schedule goes on from: resumed with a larger max_epochs,
    the run trains from its last epoch's state and runs the phase again after the new epochs,
    ending as the longer run does (its weights and metrics.jsonl records)."""
    seqs = cyclic_sequences(tmp_path, num_users=40)
    straight = Trainer(PHASED.with_(max_epochs=3), seqs, tmp_path / "a", dataset="d", seed=3,
                       progress_bar=False, log=lambda _: None)
    straight.fit()
    first = Trainer(PHASED, seqs, tmp_path / "b", dataset="d", seed=3, progress_bar=False,
                    log=lambda _: None).fit()
    assert first.progress.rank_phase_done and first.progress.epoch == 2
    resumed = Trainer(PHASED.with_(max_epochs=3), seqs, tmp_path / "b", dataset="d", seed=3,
                      progress_bar=False, log=lambda _: None)
    result = resumed.fit(resume=True)
    assert result.progress.epoch == 3 and result.progress.rank_phase_done
    _same_weights(tmp_path / "a", tmp_path / "b")
    for (name, x), (_, y) in zip(straight.model.state_dict().items(),
                                 resumed.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name        # the last epoch's, in the state
    records = _records(tmp_path / "b")
    assert records == _records(tmp_path / "a")
    assert [r.get("epoch", "phase") for r in records] == [1, 2, 3, "phase", "phase"]


class _Clock:
    """A ``time`` whose ``perf_counter`` advances 1 s a call: a budget stops deterministically."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_a_run_its_time_budget_stopped_is_finished_until_its_schedule_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumed with the same arguments, a run its budget stopped trains nothing (decided with
    its last epoch's time, as when it stopped); a larger budget reopens it, and the ranking
    phase follows the new epochs."""
    seqs = cyclic_sequences(tmp_path, num_users=40)
    config = PHASED.with_(max_epochs=10, time_budget_s=4.5)
    run = tmp_path / "run"

    def session(budget_s: float) -> tuple[TrainProgress, list[str]]:
        monkeypatch.setattr("relaygr.train.trainer.time", _Clock())
        logs: list[str] = []
        result = Trainer(config.with_(time_budget_s=budget_s), seqs, run, dataset="d", seed=3,
                         progress_bar=False, log=logs.append).fit(resume=run.exists())
        return result.progress, logs

    first, _ = session(4.5)
    assert first.stopped.startswith("time budget") and first.rank_phase_done
    records = (run / "metrics.jsonl").read_text()
    again, logs = session(4.5)
    assert again.epoch == first.epoch and again.stopped == first.stopped
    assert f"run already finished: {first.stopped}" in logs
    assert (run / "metrics.jsonl").read_text() == records
    longer, _ = session(9.5)
    assert longer.epoch > first.epoch and longer.rank_phase_done
    kinds = [r.get("epoch", "phase") for r in _records(run)]
    assert kinds == [*range(1, longer.epoch + 1), "phase", "phase"]


def test_a_ranking_phase_stopped_before_its_state_is_saved_is_redone_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after the phase wrote its model and records but before the state recorded it,
    the run resumed runs the phase again from the schedule's best weights (saved apart from
    the model), ending as the run never stopped."""
    seqs = cyclic_sequences(tmp_path, num_users=40)
    Trainer(PHASED, seqs, tmp_path / "a", dataset="d", seed=3, progress_bar=False,
            log=lambda _: None).fit()
    save = checkpoint.save_train_state

    def killed(run_dir: Path, model: HSTU, optimizer: torch.optim.Optimizer,
               progress: TrainProgress, gen: torch.Generator) -> None:
        if progress.rank_phase_done:
            raise KeyboardInterrupt
        save(run_dir, model, optimizer, progress, gen)

    monkeypatch.setattr("relaygr.train.trainer.save_train_state", killed)
    with pytest.raises(KeyboardInterrupt):
        Trainer(PHASED, seqs, tmp_path / "b", dataset="d", seed=3, progress_bar=False,
                log=lambda _: None).fit()
    monkeypatch.undo()
    result = Trainer(PHASED, seqs, tmp_path / "b", dataset="d", seed=3, progress_bar=False,
                     log=lambda _: None).fit(resume=True)
    assert result.progress.rank_phase_done
    _same_weights(tmp_path / "a", tmp_path / "b")
    assert _records(tmp_path / "b") == _records(tmp_path / "a")


def test_an_epoch_stopped_before_its_state_is_saved_is_recorded_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Epoch 2's validation record is written before its state; stopped between the two, the
    resumed run trains epoch 2 again and metrics.jsonl holds its record once."""
    seqs = cyclic_sequences(tmp_path, num_users=40)
    Trainer(TINY, seqs, tmp_path / "a", dataset="d", seed=2, progress_bar=False,
            log=lambda _: None).fit()
    save = checkpoint.save_train_state

    def killed(run_dir: Path, model: HSTU, optimizer: torch.optim.Optimizer,
               progress: TrainProgress, gen: torch.Generator) -> None:
        if progress.epoch == 2:
            raise KeyboardInterrupt
        save(run_dir, model, optimizer, progress, gen)

    monkeypatch.setattr("relaygr.train.trainer.save_train_state", killed)
    with pytest.raises(KeyboardInterrupt):
        Trainer(TINY, seqs, tmp_path / "b", dataset="d", seed=2, progress_bar=False,
                log=lambda _: None).fit()
    monkeypatch.undo()
    assert [r["epoch"] for r in _records(tmp_path / "b")] == [1, 2]
    Trainer(TINY, seqs, tmp_path / "b", dataset="d", seed=2, progress_bar=False,
            log=lambda _: None).fit(resume=True)
    assert _records(tmp_path / "b") == _records(tmp_path / "a")



def test_a_run_saved_before_a_field_existed_names_it_when_a_preset_changed_it(
        tmp_path: Path) -> None:
    """A run saved before ``layer_style`` existed trained "ours" layers; the presets now say
    "reference", so its own command line no longer resumes it: the refusal names the field and
    its trained value, and with that value set the run resumes."""
    seqs = cyclic_sequences(tmp_path, num_users=20)
    run = tmp_path / "run"
    Trainer(TINY.with_(max_epochs=1), seqs, run, dataset="d", progress_bar=False,
            log=lambda _: None).fit()
    config = json.loads((run / checkpoint.CONFIG_FILE).read_text())
    for section in ("model", "train"):
        del config[section]["layer_style"]              # as written before the field existed
    (run / checkpoint.CONFIG_FILE).write_text(json.dumps(config))
    preset_now = TINY.with_(layer_style="reference")
    with pytest.raises(CheckpointError, match=r"model\.layer_style: trained 'ours', now "
                                              r"'reference'; train\.layer_style: trained 'ours'"):
        Trainer(preset_now, seqs, run, dataset="d", progress_bar=False).fit(resume=True)
    result = Trainer(preset_now.with_(layer_style="ours"), seqs, run, dataset="d",
                     progress_bar=False, log=lambda _: None).fit(resume=True)
    assert result.progress.epoch == 2
