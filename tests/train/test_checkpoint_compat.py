"""A run's files: one saved before the ranking head's options existed loads as the model it was,
and its config and progress files are read by the one loader (settings.load), refusing what they
do not hold by its path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relaygr.errors import CheckpointError
from relaygr.train import Trainer, load_trained
from relaygr.train.checkpoint import (
    PROGRESS_FILE,
    DatasetInfo,
    RunConfig,
    TrainProgress,
    load_train_state,
)
from tests.train.helpers import TINY, cyclic_sequences

NEW_MODEL_KEYS = ("rank_score",)
NEW_TRAIN_KEYS = ("rank_score", "rank_hard_negatives", "rank_mine_k")


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


def test_a_progress_file_is_read_by_the_one_loader(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=16)
    trainer = Trainer(TINY.with_(max_epochs=1), seqs, tmp_path / "run", dataset="d",
                      progress_bar=False, log=lambda _: None)
    trainer.fit()
    path = tmp_path / "run" / PROGRESS_FILE
    saved = json.loads(path.read_text())

    def load_with(progress: dict) -> TrainProgress:
        path.write_text(json.dumps(progress))
        return load_train_state(tmp_path / "run", trainer.model, trainer.optimizer, trainer.gen)

    assert load_with(saved) == TrainProgress(**saved)
    for bad, says in (({**saved, "epochs": 1}, r"unknown TrainProgress keys: \['epochs'\]"),
                      ({**saved, "epoch": "one"}, r"TrainProgress\.epoch: Input should be")):
        with pytest.raises(CheckpointError, match=says):
            load_with(bad)
