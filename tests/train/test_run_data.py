"""What an HSTU run trained on (``training_split``, the trainer's) and the share of an
evaluation's targets among it, read from the data the run records (``check_held_out``); not
measured where that data no longer holds what the run recorded: its counts, its rows, or each
user's order of its events (the same rows in another file order, events of one timestamp
ordered otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from relaygr.data import IdMap, leave_one_out, load_sequences
from relaygr.errors import ConfigError
from relaygr.train import load_trained
from relaygr.train.run_data import check_held_out, trained_targets, training_split
from relaygr.train.trainer import Trainer
from tests.train.helpers import (
    TINY,
    write_cyclic_udata,
    write_tied_udata,
    write_truncated,
    write_untrained_run,
)


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


def test_the_recorded_rows_ordering_users_otherwise_are_not_measured(tmp_path: Path) -> None:
    # each user's last two events tie on their timestamp; 10 users held their validation item
    # out, the 30 others trained on it
    config = TINY.with_(valid_users=10, valid_seed=3)
    recorded = write_tied_udata(tmp_path / "recorded" / "u.data")
    seqs = load_sequences("ml-100k", recorded)
    run = load_trained(write_untrained_run(tmp_path / "run", seqs, config))
    # the same rows, each user's tied pair in the other file order: the test target is the
    # item the run validated on, one it trained on for most users
    swapped = write_tied_udata(tmp_path / "swapped" / "u.data", swapped=True)
    other = load_sequences("ml-100k", swapped, id_map=seqs.id_map)
    assert other.fingerprint == seqs.fingerprint
    cases = leave_one_out(other).test
    trained_on = trained_targets(training_split(seqs, config), other, cases).mean()
    assert trained_on == 0.75
    # the run's split is rebuilt from the recorded file, in its order: measured
    assert check_held_out(run, other, cases).share == trained_on
    # the recorded file rewritten in the other order since: rebuilt from it, the run's split
    # would hold those targets out (a share of 0 on its own data), so it is not measured
    recorded.write_text(swapped.read_text())
    now = load_sequences("ml-100k", recorded, id_map=seqs.id_map)
    for evaluated in (now, other):
        check = check_held_out(run, evaluated, leave_one_out(evaluated).test)
        assert (check.same_data, check.share, check.measured) == (evaluated is now, None, False)
        assert check.unverified.startswith("its rows are those the run recorded, but in a file "
                                           "order that orders its users' sequences otherwise")


def test_a_run_saved_before_it_recorded_its_sequences_is_checked_by_its_rows(
        tmp_path: Path) -> None:
    recorded = write_tied_udata(tmp_path / "recorded" / "u.data")
    seqs = load_sequences("ml-100k", recorded)
    run = write_untrained_run(tmp_path / "run", seqs)
    config = json.loads((run / "config.json").read_text())
    assert config["dataset"]["sequence_fingerprint"] == seqs.sequence_fingerprint
    del config["dataset"]["sequence_fingerprint"]     # as saved before runs recorded it
    (run / "config.json").write_text(json.dumps(config))
    old = load_trained(run)
    assert old.run.dataset.sequence_fingerprint is None
    assert old.run.dataset.fingerprint == seqs.fingerprint
    # its rows rewritten in another order cannot be told from its own: measured, as before
    lines = write_tied_udata(tmp_path / "swapped" / "u.data", swapped=True).read_text()
    recorded.write_text(lines)
    now = load_sequences("ml-100k", recorded, id_map=seqs.id_map)
    assert check_held_out(old, now, leave_one_out(now).test).measured
    # other rows of its counts still can: users 1 and 2 trade ids
    recorded.write_text("".join("\t".join([{"1": "2", "2": "1"}.get(user, user), *rest])
                                for user, *rest in (line.split("\t")
                                                    for line in lines.splitlines(True))))
    now = load_sequences("ml-100k", recorded, id_map=seqs.id_map)
    check = check_held_out(old, now, leave_one_out(now).test)
    assert check.share is None and check.unverified.startswith("its rows are not those")
