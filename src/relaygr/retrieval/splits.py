"""Evaluation protocols and the train / validation / test splits they need, with fixed-seed
negatives.

- ``cvgae`` (CVGAE, TKDE 2025): ``train`` and ``test_original`` merged; one random interaction
  per user held out for test; 99 negatives the user never interacted with; HR/NDCG@10.
- ``disencdr`` (DisenCDR, SIGIR 2022): the released ``test.txt``; 999 negatives.
- ``full``: a run's own test rows (``disencdr`` or ``cvgae`` split) ranked against every item of
  the domain, the user's training (and validation) items masked; HIT@50/100/200.

Every split also carves a validation set from the training interactions (one random item from
each of ``valid_share`` of the users, negatives as the protocol's): epochs and options are chosen
on it, never on test. Invariants (checked by ``check``): train, validation and test are disjoint;
no negative is an item its user ever interacted with in the domain's files; negatives of a user
are distinct.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from relaygr.errors import CheckpointError, ConfigError
from relaygr.retrieval.data import Domain
from relaygr.retrieval.graph import pair_keys


class SplitKind(str, Enum):
    CVGAE = "cvgae"
    DISENCDR = "disencdr"


class Protocol(str, Enum):
    CVGAE = "cvgae"
    DISENCDR = "disencdr"
    FULL = "full"

    @property
    def split_kind(self) -> SplitKind:
        """The split a run needs to be evaluated under this protocol (``full``: any)."""
        return SplitKind.CVGAE if self is Protocol.CVGAE else SplitKind.DISENCDR

    def accepts(self, kind: SplitKind) -> bool:
        return self is Protocol.FULL or kind is self.split_kind

    @classmethod
    def parse(cls, name: str) -> Protocol:
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(f"protocol must be one of {[p.value for p in cls]}; "
                              f"got {name!r}") from None


NUM_NEGATIVES = {SplitKind.CVGAE: 99, SplitKind.DISENCDR: 999}


@dataclass(frozen=True)
class DomainSplit:
    """One domain's split: ``(n, 2)`` (user, item) arrays and ``(rows, k)`` negatives aligned
    with ``valid`` / ``test`` rows."""

    name: str
    kind: SplitKind
    num_items: int
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    valid_negatives: np.ndarray
    test_negatives: np.ndarray
    # ``(len(train),)`` int64: each training row's place in its user's time order (larger is
    # newer), where the domain is time-ordered (``Domain.time_ordered``); None: no order
    train_pos: np.ndarray | None = None

    def check(self, seen: np.ndarray) -> None:
        """Assert the module's invariants; ``seen`` is every (user, item) of the domain."""
        keys = [pair_keys(a) for a in (self.train, self.valid, self.test)]
        for i in range(3):
            for j in range(i + 1, 3):
                assert not np.intersect1d(keys[i], keys[j]).size, "split parts overlap"
        seen_keys = pair_keys(seen)
        for rows, negs in ((self.valid, self.valid_negatives), (self.test, self.test_negatives)):
            pairs = np.stack([np.repeat(rows[:, 0], negs.shape[1]), negs.ravel()], axis=1)
            assert not np.isin(pair_keys(pairs), seen_keys).any(), "a negative was interacted with"
            srt = np.sort(negs, axis=1)
            assert not (srt[:, 1:] == srt[:, :-1]).any(), "repeated negative"

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, Any] = {
            "kind": self.kind.value, "num_items": self.num_items, "train": self.train,
            "valid": self.valid, "test": self.test, "valid_negatives": self.valid_negatives,
            "test_negatives": self.test_negatives}
        if self.train_pos is not None:
            arrays["train_pos"] = self.train_pos
        with path.open("wb") as fh:   # a file object: numpy adds no ".npz" to the name
            np.savez_compressed(fh, **arrays)

    @classmethod
    def load(cls, path: Path, name: str) -> DomainSplit:
        if not path.is_file():
            raise CheckpointError(f"split file missing: {path}")
        z = np.load(path)
        return cls(name, SplitKind(str(z["kind"])), int(z["num_items"]), z["train"], z["valid"],
                   z["test"], z["valid_negatives"], z["test_negatives"],
                   z["train_pos"] if "train_pos" in z.files else None)


def _rng(seed: int, name: str, purpose: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(f"{name}/{purpose}".encode())])


def hold_out_one(pairs: np.ndarray, users: np.ndarray, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray]:
    """One uniformly random interaction of each user in ``users`` → (rest, held out).

    Users with a single interaction keep it (nothing is held out for them)."""
    order = np.lexsort((rng.random(len(pairs)), pairs[:, 0]))
    shuffled = pairs[order]
    first = np.r_[True, shuffled[1:, 0] != shuffled[:-1, 0]]
    counts = np.bincount(shuffled[:, 0])
    take = first & np.isin(shuffled[:, 0], users) & (counts[shuffled[:, 0]] > 1)
    return shuffled[~take], shuffled[take]


def sample_negatives(rows: np.ndarray, seen: np.ndarray, num_items: int, k: int,
                     rng: np.random.Generator, universe: np.ndarray | None = None
                     ) -> np.ndarray:
    """``k`` distinct items per row's user, uniform over the items the user never interacted
    with (``seen``: every (user, item) of the domain) among ``universe`` (sorted distinct item
    ids; None: all ``num_items``). Rows in order; ``(len(rows), k)``."""
    order = np.argsort(seen[:, 0], kind="stable")
    by_user = np.split(seen[order, 1], np.cumsum(np.bincount(seen[:, 0]))[:-1])
    out = np.empty((len(rows), k), dtype=np.int64)
    for r, user in enumerate(rows[:, 0]):
        banned = by_user[user] if user < len(by_user) else np.empty(0, np.int64)
        allowed = num_items if universe is None else len(universe)
        inside = np.unique(banned) if universe is None else np.intersect1d(banned, universe)
        if allowed - len(inside) < k:
            raise ConfigError(f"user {user} has fewer than {k} items to sample negatives from")
        picked = np.empty(0, dtype=np.int64)
        while len(picked) < k:
            draw = rng.integers(0, allowed, size=2 * k)
            if universe is not None:
                draw = universe[draw]
            draw = draw[~np.isin(draw, banned)]
            picked = np.concatenate([picked, draw])
            _, first = np.unique(picked, return_index=True)
            picked = picked[np.sort(first)]
        out[r] = picked[:k]
    return out


def time_positions(pairs: np.ndarray, sequence: np.ndarray) -> np.ndarray:
    """``(len(pairs),)`` int64: the index of each (user, item) row's last occurrence in
    ``sequence`` (the domain's training rows, each user's in time order), ``len(sequence)``
    (newer than all: a held-out last event) for a row it lacks."""
    keys, seq_keys = pair_keys(pairs), pair_keys(sequence)
    order = np.argsort(seq_keys, kind="stable")
    sorted_keys = seq_keys[order]
    at = np.searchsorted(sorted_keys, keys, side="right") - 1   # the last of equal keys
    found = (at >= 0) & (sorted_keys[np.clip(at, 0, None)] == keys)
    return np.where(found, order[np.clip(at, 0, None)], len(sequence)).astype(np.int64)


def make_split(domain: Domain, kind: SplitKind, seed: int, valid_share: float) -> DomainSplit:
    """The ``kind`` split of ``domain`` under ``seed`` (see the module doc)."""
    seen = np.unique(np.concatenate([domain.train, domain.test, domain.test_original]), axis=0)
    if kind is SplitKind.CVGAE:
        merged = np.unique(np.concatenate([domain.train, domain.test_original]), axis=0)
        rest, test = hold_out_one(merged, np.unique(merged[:, 0]), _rng(seed, domain.name, "test"))
    else:
        rest, test = domain.train, domain.test
    users = np.unique(rest[:, 0])
    chosen = _rng(seed, domain.name, "valid-users").random(len(users)) < valid_share
    train, valid = hold_out_one(rest, users[chosen], _rng(seed, domain.name, "valid"))
    k = NUM_NEGATIVES[kind]
    train = train[np.lexsort((train[:, 1], train[:, 0]))]
    # DisenCDR numbers and draws its negatives among the items of train.txt: an id the files
    # name only in held-out rows (test.txt, test_original.txt) is no negative there (degree 0
    # in training, any popularity prior beats it for free). Ids no file names stay (the
    # released files have none; generated ones may).
    universe = None
    if kind is SplitKind.DISENCDR:
        held_only = np.setdiff1d(np.concatenate([domain.test[:, 1], domain.test_original[:, 1]]),
                                 domain.train[:, 1])
        universe = np.setdiff1d(np.arange(domain.num_items), held_only)
    split = DomainSplit(
        domain.name, kind, domain.num_items, train, valid, test,
        sample_negatives(valid, seen, domain.num_items, k, _rng(seed, domain.name, "valid-neg"),
                         universe),
        sample_negatives(test, seen, domain.num_items, k, _rng(seed, domain.name, "test-neg"),
                         universe),
        time_positions(train, domain.train) if domain.time_ordered else None)
    split.check(seen)
    return split
