"""Leave-one-out split (SASRec, HSTU): per user, the last item is the test target, the one
before it the validation target, and everything earlier is training data.

A user with fewer than ``MIN_EVAL_LENGTH`` events has no room for both targets and a history:
all of its events train, and it is not evaluated (none such exist in MovieLens, whose users have
20 or more ratings).

``hold_out_validation_of``: the reference HSTU code trains on everything but the test item. This
keeps that protocol and still validates honestly: only a seeded sample of users keeps its
validation item out of training (and is validated on it); every other user trains on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relaygr.data.sequences import UserSequences
from relaygr.errors import ConfigError, EmptyDatasetError

MIN_EVAL_LENGTH = 3


@dataclass(frozen=True)
class EvalCases:
    """Next-item cases: user ``users[j]`` has history ``sequence(users[j])[:history_lengths[j]]``
    and must find ``targets[j]``, the item at index ``history_lengths[j]`` of its sequence."""

    users: np.ndarray            # [N] dense user indices
    history_lengths: np.ndarray  # [N] >= 1
    targets: np.ndarray          # [N] dense item ids

    def __len__(self) -> int:
        return len(self.users)


@dataclass(frozen=True)
class LeaveOneOutSplit:
    """Training prefixes (``train_lengths[u]`` first events of user ``u``) and the two
    evaluation sets. The test history includes the validation target."""

    sequences: UserSequences
    train_lengths: np.ndarray  # [U]
    valid: EvalCases
    test: EvalCases


def leave_one_out(sequences: UserSequences) -> LeaveOneOutSplit:
    lengths = sequences.lengths
    evaluated = lengths >= MIN_EVAL_LENGTH
    if not evaluated.any():
        raise EmptyDatasetError(f"no user has {MIN_EVAL_LENGTH} or more interactions, so "
                                "leave-one-out has nothing to evaluate", sequences.source)
    train_lengths = np.where(evaluated, lengths - 2, lengths)
    users = np.flatnonzero(evaluated)
    last = sequences.offsets[users + 1] - 1  # flat index of each evaluated user's last event

    def cases(history: np.ndarray, flat_target: np.ndarray) -> EvalCases:
        return EvalCases(users=users, history_lengths=history,
                         targets=sequences.items[flat_target])

    return LeaveOneOutSplit(
        sequences=sequences, train_lengths=train_lengths,
        valid=cases(lengths[users] - 2, last - 1),
        test=cases(lengths[users] - 1, last))


def hold_out_validation_of(split: LeaveOneOutSplit, num_users: int, seed: int
                           ) -> LeaveOneOutSplit:
    """``split`` with the validation item held out for ``num_users`` seeded-random evaluated
    users only: they alone are validated; every other evaluated user trains on its validation
    item too (its training prefix is all but the test item). The test set is unchanged."""
    evaluated = split.valid.users
    if not 0 < num_users <= len(evaluated):
        raise ConfigError(f"cannot hold out the validation item of {num_users} users: "
                          f"{len(evaluated)} are evaluated")
    keep = np.sort(np.random.default_rng(seed).choice(len(evaluated), num_users,
                                                      replace=False))
    train_lengths = split.train_lengths.copy()
    train_lengths[evaluated] += 1
    train_lengths[evaluated[keep]] -= 1
    valid = EvalCases(users=evaluated[keep], history_lengths=split.valid.history_lengths[keep],
                      targets=split.valid.targets[keep])
    return LeaveOneOutSplit(sequences=split.sequences, train_lengths=train_lengths, valid=valid,
                            test=split.test)
