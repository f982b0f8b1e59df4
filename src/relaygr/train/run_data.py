"""What an HSTU run trained on, and whether an evaluation's targets were held out of it.

``training_split``: the split ``Trainer`` trains on (leave-one-out; with ``valid_users`` only
that seeded sample of users keeps its validation item out of training). One function, so the
check below reads exactly the events the run saw.

``check_held_out``: a run evaluated on other data than it recorded (``DatasetInfo.source``), for
example an HSTU run serving as the cascade's stage of ``relaygr eval --retrieval RUN``, may have
trained on the evaluated targets. The run's recorded data is read again (the evaluated data
itself when it is the same file) and each target is matched to the run's training prefix of the
same user (the dataset's user id; ids of another kind, strings against integers, match no user).
A target counts as trained on when the run saw that item more often than the evaluated history
holds it: a repeat of an item the history already holds is no leak, and on its own data a run
never trains on a target (``share`` 0). Data that cannot be
read, or that no longer holds what the run recorded (its users and events, its rows when the
run records their fingerprint, ``DatasetInfo.fingerprint``, and its users' sequences when it
records theirs, ``DatasetInfo.sequence_fingerprint``), is not measured (``share`` None, with the
reason): the caller must say so, never report the figures as a clean test. The same rows in
another file order are such data where the order orders a user's events otherwise (events of
one timestamp keep their file order): the split rebuilt from them would hold out other items
than the run did, and a target reported as held out could be one the run trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from relaygr.data import TableSpec, load_sequences
from relaygr.data.sequences import UserSequences
from relaygr.data.split import EvalCases, LeaveOneOutSplit, hold_out_validation_of, leave_one_out
from relaygr.errors import ConfigError, DataError
from relaygr.train.checkpoint import TrainedModel
from relaygr.train.config import TrainConfig


def training_split(sequences: UserSequences, config: TrainConfig) -> LeaveOneOutSplit:
    """The split a run of ``config`` trains on (module docstring)."""
    split = leave_one_out(sequences)
    if 0 < config.valid_users < len(split.valid):   # else every user is validated
        split = hold_out_validation_of(split, config.valid_users, config.valid_seed)
    return split


@dataclass(frozen=True)
class HeldOutCheck:
    """An evaluation's targets against a run's training: ``source`` the data the run records,
    ``same_data`` whether that is the evaluated file, ``share`` the share of the targets the run
    trained on, None when it could not be measured (``unverified`` says why; "" when
    measured)."""

    source: str
    same_data: bool
    share: float | None
    unverified: str = ""

    @property
    def measured(self) -> bool:
        return self.share is not None


def check_held_out(run: TrainedModel, seqs: UserSequences, cases: EvalCases,
                   spec: TableSpec | None = None) -> HeldOutCheck:
    """``cases`` of ``seqs`` (read with ``run.id_map``, else ``ConfigError``) against what
    ``run`` trained on (module docstring); ``spec``: the columns of a generic table, as the
    evaluated data was read with."""
    if seqs.id_map != run.id_map:
        raise ConfigError(f"{seqs.source} was read with other item ids than the run's: its "
                          "targets cannot be matched to the run's training")
    info = run.run.dataset
    same = Path(info.source).resolve() == Path(seqs.source).resolve()
    trained = seqs
    if not same:
        if not Path(info.source).is_file():
            return HeldOutCheck(info.source, same, None, "not readable here")
        try:
            trained = load_sequences(info.name, Path(info.source), spec, run.id_map)
        except DataError as exc:
            return HeldOutCheck(info.source, same, None, f"not readable as {info.name}: {exc}")
    now = (trained.num_users, trained.num_events)
    if now != (info.num_users, info.num_events):
        return HeldOutCheck(info.source, same, None,
                            f"it holds {now[0]} users / {now[1]} interactions, the run "
                            f"recorded {info.num_users} / {info.num_events}")
    if info.fingerprint is not None and trained.fingerprint != info.fingerprint:
        return HeldOutCheck(info.source, same, None,
                            f"its rows are not those the run recorded (fingerprint "
                            f"{trained.fingerprint}, recorded {info.fingerprint})")
    if info.sequence_fingerprint not in (None, trained.sequence_fingerprint):
        return HeldOutCheck(info.source, same, None,
                            "its rows are those the run recorded, but in a file order that "
                            "orders its users' sequences otherwise (a user's events of one "
                            "timestamp, or without timestamps, keep their file order), so the "
                            "run's split cannot be rebuilt from it "
                            f"(sequence fingerprint {trained.sequence_fingerprint}, recorded "
                            f"{info.sequence_fingerprint})")
    held = trained_targets(training_split(trained, run.run.train), seqs, cases)
    return HeldOutCheck(info.source, same, float(held.mean()) if len(cases) else 0.0)


def trained_targets(training: LeaveOneOutSplit, seqs: UserSequences,
                    cases: EvalCases) -> np.ndarray:
    """``[len(cases)]`` bool: whether ``training`` (a run's split, over the same item ids as
    ``seqs``) trained on each case's target more often than the case's history holds it."""
    trained = training.sequences
    users = seqs.user_ids[cases.users]
    if (trained.user_ids.dtype.kind in "iu") != (users.dtype.kind in "iu"):
        # integer ids against strings (a reader keeps strings only where one is no integer):
        # no evaluated user is one of the run's, and the two cannot be compared in order
        return np.zeros(len(cases), dtype=bool)
    rows = np.minimum(np.searchsorted(trained.user_ids, users), trained.num_users - 1)
    known = trained.user_ids[rows] == users        # users the run's data does not hold: False
    out = np.zeros(len(cases), dtype=bool)
    for j in np.flatnonzero(known).tolist():
        start = int(trained.offsets[rows[j]])
        prefix = trained.items[start:start + int(training.train_lengths[rows[j]])]
        history = seqs.sequence(int(cases.users[j]))[:int(cases.history_lengths[j])]
        target = cases.targets[j]
        out[j] = np.count_nonzero(prefix == target) > np.count_nonzero(history == target)
    return out
