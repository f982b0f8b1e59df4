"""What an HSTU run trained on (``training_split``, the trainer's) and the share of an
evaluation's targets among it, read from the data the run records (``check_held_out``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relaygr.data import IdMap, leave_one_out, load_sequences
from relaygr.errors import ConfigError
from relaygr.train import load_trained
from relaygr.train.run_data import check_held_out, training_split
from relaygr.train.trainer import Trainer
from tests.train.helpers import TINY, write_cyclic_udata, write_truncated, write_untrained_run


def test_the_split_checked_is_the_one_the_trainer_trains_on(tmp_path: Path) -> None:
    seqs = load_sequences("ml-100k", write_cyclic_udata(tmp_path / "u.data", num_users=40))
    for config in (TINY, TINY.with_(valid_users=10, valid_seed=3)):
        trainer = Trainer(config, seqs, tmp_path / "run", dataset="ml-100k", progress_bar=False)
        np.testing.assert_array_equal(trainer.split.train_lengths,
                                      training_split(seqs, config).train_lengths)
    held = training_split(seqs, TINY.with_(valid_users=10, valid_seed=3))
    assert len(held.valid) == 10      # the others train on their validation item
    assert (held.train_lengths == seqs.lengths - 1).sum() == 30


def test_a_run_on_the_evaluated_data_held_out_every_target_even_a_repeated_item(
        tmp_path: Path) -> None:
    seqs = load_sequences("ml-100k", write_cyclic_udata(tmp_path / "u.data", num_users=40))
    run = load_trained(write_untrained_run(tmp_path / "run", seqs))
    cases = leave_one_out(seqs).test
    # this data repeats items: some test targets are items of their user's training prefix
    repeats = [t in seqs.sequence(u)[:n - 1] for u, n, t in
               zip(cases.users, cases.history_lengths, cases.targets, strict=True)]
    assert any(repeats)
    check = check_held_out(run, seqs, cases)
    assert (check.source, check.same_data, check.share, check.unverified) == (
        str(tmp_path / "u.data"), True, 0.0, "")


def test_the_share_is_of_the_targets_the_run_trained_on(tmp_path: Path) -> None:
    seqs = load_sequences("ml-100k", write_cyclic_udata(tmp_path / "u.data", num_users=40))
    # validation targets: 10 seeded users held theirs out, the other 30 trained on theirs
    config = TINY.with_(valid_users=10, valid_seed=3)
    run = load_trained(write_untrained_run(tmp_path / "run", seqs, config))
    assert check_held_out(run, seqs, leave_one_out(seqs).valid).share == 0.75
    assert check_held_out(run, seqs, training_split(seqs, config).valid).share == 0.0
    # a run on the whole log, evaluated on the log without the last two events of users 1-10:
    # those users' test targets are events it trained on, the 30 others' are its test targets
    early = write_truncated(tmp_path / "u.data", tmp_path / "early", lambda user: user <= 10)
    early_seqs = load_sequences("ml-100k", early, id_map=seqs.id_map)
    whole = load_trained(write_untrained_run(tmp_path / "whole", seqs))
    check = check_held_out(whole, early_seqs, leave_one_out(early_seqs).test)
    assert (check.same_data, check.share) == (False, 0.25)
    # a user the run's data does not hold is not one it trained on: users 1-4 left out
    lines = (tmp_path / "u.data").read_text().splitlines(keepends=True)
    (tmp_path / "later").mkdir()
    (tmp_path / "later" / "u.data").write_text(
        "".join(line for line in lines if int(line.split("\t")[0]) > 4))
    later = load_sequences("ml-100k", tmp_path / "later", id_map=seqs.id_map)
    partial = load_trained(write_untrained_run(tmp_path / "partial", later))
    assert check_held_out(partial, early_seqs, leave_one_out(early_seqs).test).share == 6 / 40


def test_data_that_cannot_be_read_or_has_changed_is_not_measured(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    full = write_cyclic_udata(tmp_path / "full" / "u.data", num_users=40)
    seqs = load_sequences("ml-100k", full)
    early = write_truncated(full, tmp_path / "early", lambda user: True)
    early_seqs = load_sequences("ml-100k", early, id_map=seqs.id_map)
    cases = leave_one_out(early_seqs).test
    run = load_trained(write_untrained_run(tmp_path / "run", seqs))
    assert check_held_out(run, early_seqs, cases).share == 1.0
    # rewritten since the run: fewer events than it recorded
    full.write_text("".join(full.read_text().splitlines(keepends=True)[:-3]))
    changed = check_held_out(run, early_seqs, cases)
    assert (changed.share, changed.measured) == (None, False)
    assert changed.unverified == (f"it holds 40 users / {seqs.num_events - 3} interactions, "
                                  f"the run recorded 40 / {seqs.num_events}")
    full.unlink()
    gone = check_held_out(run, early_seqs, cases)
    assert (gone.source, gone.share, gone.unverified) == (str(full), None, "not readable here")
    with pytest.raises(ConfigError, match="other item ids than the run's"):
        other = load_sequences("ml-100k", early, id_map=IdMap((*seqs.id_map.items, 10**6)))
        check_held_out(run, other, leave_one_out(other).test)


def test_data_of_the_recorded_counts_but_other_rows_is_not_measured(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    full = write_cyclic_udata(tmp_path / "full" / "u.data", num_users=40)
    seqs = load_sequences("ml-100k", full)
    run = load_trained(write_untrained_run(tmp_path / "run", seqs))
    early = write_truncated(full, tmp_path / "early", lambda user: True)
    early_seqs = load_sequences("ml-100k", early, id_map=seqs.id_map)
    cases = leave_one_out(early_seqs).test
    # rewritten since the run: users 1 and 2 trade ids, the counts stay the run's
    swap = {"1": "2", "2": "1"}
    full.write_text("".join("\t".join([swap.get(user, user), *rest]) for user, *rest in
                            (line.split("\t") for line in full.read_text().splitlines(True))))
    changed = check_held_out(run, early_seqs, cases)
    assert (changed.share, changed.measured) == (None, False)
    assert changed.unverified.startswith("its rows are not those the run recorded")
