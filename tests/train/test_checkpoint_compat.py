"""A run's files: one saved before the ranking head's options existed loads as the model it was,
one saved before runs recorded their data's fingerprints loads and resumes without them, and its
config and progress files are read by the one loader (settings.load), refusing what they do not
hold by its path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from relaygr.data import UserSequences, load_sequences, resolve, table_fingerprint
from relaygr.errors import CheckpointError
from relaygr.train import Trainer, load_trained, read_run_config
from relaygr.train.checkpoint import (
    CONFIG_FILE,
    PROGRESS_FILE,
    SCHEDULE_BEST_FILE,
    STATE_FILE,
    DatasetInfo,
    RunConfig,
    TrainProgress,
    load_train_state,
)
from tests.train.helpers import TINY, cyclic_sequences, write_tied_udata

NEW_MODEL_KEYS = ("rank_score", "layer_style", "time_query")
NEW_TRAIN_KEYS = ("rank_score", "rank_hard_negatives", "rank_mine_k", "layer_style",
                  "time_query")


def test_a_config_without_the_new_keys_loads_as_the_state_head(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=16)
    trainer = Trainer(TINY.with_(max_epochs=1), seqs, tmp_path / "run", dataset="d",
                      progress_bar=False, log=lambda _: None)
    trainer.fit()
    path = tmp_path / "run" / "config.json"
    config = json.loads(path.read_text())
    for key in NEW_MODEL_KEYS:
        del config["model"][key]
    for key in NEW_TRAIN_KEYS:
        del config["train"][key]
    path.write_text(json.dumps(config))
    old = load_trained(tmp_path / "run")
    assert old.model.cfg.rank_score == "state"
    assert old.model.cfg.layer_style == "ours" and old.run.train.layer_style == "ours"
    assert old.model.cfg.time_query == "own" and old.run.train.time_query == "own"
    saved = trainer.model.eval()        # one epoch: the best epoch is the last one
    history = torch.from_numpy(seqs.sequence(0)[:10])
    kv = old.model.prefill(history)
    cands = torch.arange(1, seqs.num_items + 1)
    torch.testing.assert_close(old.model.rank(cands, prefix=kv), saved.rank(cands, prefix=kv),
                               rtol=0, atol=0)


def test_a_run_saved_before_valid_seed_keeps_the_users_its_seed_chose(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=16)
    Trainer(TINY.with_(max_epochs=1, valid_users=4), seqs, tmp_path / "run", dataset="d",
            seed=3, progress_bar=False, log=lambda _: None).fit()
    path = tmp_path / "run" / "config.json"
    config = json.loads(path.read_text())
    assert config["train"]["valid_seed"] == 0            # new runs: their own, fixed seed
    del config["train"]["valid_seed"]
    path.write_text(json.dumps(config))
    assert load_trained(tmp_path / "run").run.train.valid_seed == 3


def test_a_run_records_its_rows_and_one_saved_before_loads_and_resumes_without(
        tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=16)
    run = tmp_path / "run"
    Trainer(TINY.with_(max_epochs=1), seqs, run, dataset="d", progress_bar=False,
            log=lambda _: None).fit()
    config = json.loads((run / CONFIG_FILE).read_text())
    table = resolve("ml-100k", tmp_path / "u.data").read()
    assert config["dataset"]["fingerprint"] == table_fingerprint(table) == seqs.fingerprint
    assert config["dataset"]["sequence_fingerprint"] == seqs.sequence_fingerprint
    for recorded in ("fingerprint", "sequence_fingerprint"):   # as saved before runs did
        del config["dataset"][recorded]
    (run / CONFIG_FILE).write_text(json.dumps(config))
    dataset = load_trained(run).run.dataset
    assert (dataset.fingerprint, dataset.sequence_fingerprint) == (None, None)
    # its earlier sessions' rows are not known: resumed, it still records none
    Trainer(TINY.with_(max_epochs=2), seqs, run, dataset="d", progress_bar=False,
            log=lambda _: None).fit(resume=True)
    assert read_run_config(run).dataset == DatasetInfo(**config["dataset"])


def _tied_run(tmp_path: Path) -> tuple[Path, UserSequences]:
    """A run of one epoch on a log whose users' last two events tie on their timestamp."""
    seqs = load_sequences("ml-100k", write_tied_udata(tmp_path / "data" / "u.data", 16))
    Trainer(TINY.with_(max_epochs=1), seqs, tmp_path / "run", dataset="d", progress_bar=False,
            log=lambda _: None).fit()
    return tmp_path / "run", seqs


def test_a_run_resumed_on_its_rows_ordering_users_otherwise_is_refused(tmp_path: Path) -> None:
    run, seqs = _tied_run(tmp_path)
    # its file rewritten with the same rows, each user's tied last two events in the other
    # order: other sequences, another split
    recorded = Path(seqs.source)
    recorded.write_text(write_tied_udata(tmp_path / "swapped" / "u.data", 16, swapped=True)
                        .read_text())
    swapped = load_sequences("ml-100k", recorded)
    assert (swapped.source, swapped.fingerprint) == (seqs.source, seqs.fingerprint)
    with pytest.raises(CheckpointError, match="was trained with a different config, dataset"):
        Trainer(TINY.with_(max_epochs=2), swapped, run, dataset="d", progress_bar=False,
                log=lambda _: None).fit(resume=True)


def test_a_run_saved_before_it_recorded_its_sequences_loads_and_resumes_without(
        tmp_path: Path) -> None:
    run, seqs = _tied_run(tmp_path)
    config = json.loads((run / CONFIG_FILE).read_text())
    del config["dataset"]["sequence_fingerprint"]  # as saved before runs recorded it
    (run / CONFIG_FILE).write_text(json.dumps(config))
    assert load_trained(run).run.dataset == DatasetInfo(**config["dataset"])
    assert load_trained(run).run.dataset.sequence_fingerprint is None
    # its earlier sessions' sequences are not known: resumed, it records its rows alone
    Trainer(TINY.with_(max_epochs=2), seqs, run, dataset="d", progress_bar=False,
            log=lambda _: None).fit(resume=True)
    assert read_run_config(run).dataset == DatasetInfo(**config["dataset"])
    assert read_run_config(run).dataset.fingerprint == seqs.fingerprint


def test_a_run_config_is_read_by_the_one_loader() -> None:
    run = RunConfig(TINY.model_config(40), TINY, DatasetInfo("d", "d.csv", 16, 40, 320), seed=3,
                    preset="quick")
    saved = json.loads(json.dumps(run.to_dict()))
    assert RunConfig.from_dict(saved) == run
    for path, value, says in (
            (("dataset", "users"), 16, r"unknown RunConfig\.dataset keys: \['users'\]"),
            (("model", "num_layers"), "two", r"RunConfig\.model\.num_layers: Input should be"),
            (("train", "max_epochs"), 0, r"RunConfig\.train\.max_epochs"),
            (("seed",), None, r"RunConfig\.seed")):
        bad = json.loads(json.dumps(saved))
        *outer, key = path
        target = bad
        for name in outer:
            target = target[name]
        target[key] = value
        with pytest.raises(CheckpointError, match=says):
            RunConfig.from_dict(bad)
    with pytest.raises(CheckpointError, match="not a relaygr run config"):
        RunConfig.from_dict({**saved, "format": "relaygr-run/0"})


def _resave_state(run: Path, metadata: dict[str, str] | None) -> None:
    """The run's state file written again with ``metadata`` (None: none, as before it held its
    progress)."""
    path = run / STATE_FILE
    save_file(load_file(str(path)), str(path), metadata=metadata)


def test_a_progress_record_is_read_by_the_one_loader(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=16)
    trainer = Trainer(TINY.with_(max_epochs=1), seqs, tmp_path / "run", dataset="d",
                      progress_bar=False, log=lambda _: None)
    trainer.fit()
    saved = json.loads((tmp_path / "run" / PROGRESS_FILE).read_text())

    def load_with(progress: dict) -> TrainProgress:
        _resave_state(tmp_path / "run", {"relaygr.progress": json.dumps(progress)})
        return load_train_state(tmp_path / "run", trainer.model, trainer.optimizer, trainer.gen)

    assert load_with(saved) == TrainProgress(**saved)
    for bad, says in (({**saved, "epochs": 1}, r"unknown TrainProgress keys: \['epochs'\]"),
                      ({**saved, "epoch": "one"}, r"TrainProgress\.epoch: Input should be")):
        with pytest.raises(CheckpointError, match=says):
            load_with(bad)


def test_the_state_carries_its_own_progress(tmp_path: Path) -> None:
    """A save killed between the state's rename and the progress file's leaves epoch 2's
    weights beside epoch 1's progress file: the state's own record is what resumes."""
    seqs = cyclic_sequences(tmp_path, num_users=16)
    run = tmp_path / "run"
    trainer = Trainer(TINY.with_(max_epochs=1), seqs, run, dataset="d", progress_bar=False,
                      log=lambda _: None)
    trainer.fit()
    first = (run / PROGRESS_FILE).read_text()
    Trainer(TINY.with_(max_epochs=2), seqs, run, dataset="d", progress_bar=False,
            log=lambda _: None).fit(resume=True)
    second = json.loads((run / PROGRESS_FILE).read_text())
    assert json.loads(first)["epoch"] == 1 and second["epoch"] == 2
    (run / PROGRESS_FILE).write_text(first)          # the rename that did not happen
    assert load_train_state(run, trainer.model, trainer.optimizer,
                            trainer.gen) == TrainProgress(**second)


def test_a_state_saved_without_its_progress_reads_the_progress_file(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=16)
    run = tmp_path / "run"
    trainer = Trainer(TINY.with_(max_epochs=1), seqs, run, dataset="d", progress_bar=False,
                      log=lambda _: None)
    trainer.fit()
    _resave_state(run, None)
    saved = json.loads((run / PROGRESS_FILE).read_text())
    assert load_train_state(run, trainer.model, trainer.optimizer,
                            trainer.gen) == TrainProgress(**saved)
    (run / PROGRESS_FILE).unlink()
    with pytest.raises(CheckpointError, match="has no progress for its state"):
        load_train_state(run, trainer.model, trainer.optimizer, trainer.gen)


def test_a_run_saved_before_the_schedule_file_starts_its_phase_from_its_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run saved before ``SCHEDULE_BEST_FILE`` and the progress's times existed, stopped
    before its ranking phase: its model.safetensors is the schedule's best, the phase starts
    from it, and the run ends as one never stopped."""
    seqs = cyclic_sequences(tmp_path, num_users=40)
    config = TINY.with_(rank_phase_epochs=2, rank_phase_users=16)
    Trainer(config, seqs, tmp_path / "a", dataset="d", seed=3, progress_bar=False,
            log=lambda _: None).fit()
    run = tmp_path / "b"

    def stopped(self: Trainer, progress: TrainProgress) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_rank_phase", stopped)
    with pytest.raises(KeyboardInterrupt):
        Trainer(config, seqs, run, dataset="d", seed=3, progress_bar=False,
                log=lambda _: None).fit()
    monkeypatch.undo()
    (run / SCHEDULE_BEST_FILE).unlink()
    saved = json.loads((run / PROGRESS_FILE).read_text())
    old = {k: v for k, v in saved.items() if k not in ("epoch_s", "rank_phase_s")}
    _resave_state(run, {"relaygr.progress": json.dumps(old)})
    result = Trainer(config, seqs, run, dataset="d", seed=3, progress_bar=False,
                     log=lambda _: None).fit(resume=True)
    assert result.progress.rank_phase_done and result.progress.epoch == 2
    for (name, a), (_, b) in zip(load_trained(tmp_path / "a").model.state_dict().items(),
                                 load_trained(run).model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
