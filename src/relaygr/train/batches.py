"""Training batches: next-item windows of each user's training prefix, padded per batch.

User ``u`` trains on the last ``max_seq_len + 1`` items of its training prefix: inputs are all
but the last, targets all but the first (position ``t`` predicts the item after it). Batches are
right-padded with 0 to their longest row only. The order of users in an epoch is a small strategy
object (``RandomOrder``, ``LengthBucketOrder``) driven by a seeded ``torch.Generator``, so an epoch
is reproducible from the generator state (which checkpoints save).

The ranking head trains on ``RankBatch``: a random cut point of a few users of each batch, the
history before it, and the item at it as the positive among uniform negatives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from relaygr.data.split import LeaveOneOutSplit
from relaygr.errors import EmptyDatasetError

# Users per sorting pool of LengthBucketOrder (in batches): large enough that batches are nearly
# uniform in length, small enough that an epoch still mixes short and long users.
_BUCKET_POOL_BATCHES = 32


@dataclass(frozen=True)
class TrainBatch:
    """``inputs`` / ``targets`` ``[B, T]`` padded with 0; ``timestamps`` ``[B, T]`` (the
    inputs') or None; ``query_timestamps`` ``[B]`` (timed: each row's last target's time, the
    request time after its inputs, which a ``time_query="next"`` model's last position
    measures from: ``HSTU.encode_padded``) or None; ``timed`` ``[B]`` bool, which rows'
    timestamps are real (None: all of them, or none is timed)."""

    inputs: Tensor
    targets: Tensor
    timestamps: Tensor | None
    query_timestamps: Tensor | None = None
    timed: Tensor | None = None

    def to(self, device: torch.device) -> TrainBatch:
        ts, query_ts, timed = (None if t is None else t.to(device, non_blocking=True)
                               for t in (self.timestamps, self.query_timestamps, self.timed))
        return TrainBatch(self.inputs.to(device, non_blocking=True),
                          self.targets.to(device, non_blocking=True), ts, query_ts, timed)


@dataclass(frozen=True)
class RankBatch:
    """``history`` ``[R, T]`` right-padded; ``candidates`` ``[R, C]`` with the positive in
    column 0; ``timestamps`` ``[R, T]`` or None; ``query_timestamps`` ``[R]``, the positive's
    time (the request's, which the candidates and, under ``HSTUConfig.time_query="next"``, the
    last history token measure from), or None: the last history timestamp; ``timed`` as
    ``TrainBatch``'s."""

    history: Tensor
    candidates: Tensor
    timestamps: Tensor | None
    query_timestamps: Tensor | None = None
    timed: Tensor | None = None

    def to(self, device: torch.device) -> RankBatch:
        ts, query_ts, timed = (None if t is None else t.to(device)
                               for t in (self.timestamps, self.query_timestamps, self.timed))
        return RankBatch(self.history.to(device), self.candidates.to(device), ts, query_ts,
                         timed)


class BatchOrder(Protocol):
    """Splits the row indices of one epoch into batches."""

    def batches(self, lengths: Tensor, batch_size: int, gen: torch.Generator) -> list[Tensor]:
        ...


class RandomOrder:
    """Uniformly shuffled rows."""

    def batches(self, lengths: Tensor, batch_size: int, gen: torch.Generator) -> list[Tensor]:
        return list(torch.randperm(len(lengths), generator=gen).split(batch_size))


class LengthBucketOrder:
    """Shuffled rows, sorted by length within pools of a few dozen batches, batches shuffled:
    little padding, and still a random mix of users from epoch to epoch."""

    def batches(self, lengths: Tensor, batch_size: int, gen: torch.Generator) -> list[Tensor]:
        perm = torch.randperm(len(lengths), generator=gen)
        out: list[Tensor] = []
        for pool in perm.split(batch_size * _BUCKET_POOL_BATCHES):
            ordered = pool[torch.argsort(lengths[pool], descending=True, stable=True)]
            out.extend(ordered.split(batch_size))
        return [out[i] for i in torch.randperm(len(out), generator=gen).tolist()]


BATCH_ORDERS: dict[str, type[RandomOrder] | type[LengthBucketOrder]] = {
    "random": RandomOrder, "length_buckets": LengthBucketOrder}


class TrainingData:
    """The training windows of a split, stored padded once ``[U', max_seq_len]``. Timed, a
    batch carries the time after each window (its last target's), at which it is queried, and a
    ranking example is scored at its positive's time, as serving scores candidates at the
    request's. Where only some users are timed (``TrainConfig.time_where_known``), each batch
    says which rows are (``TrainBatch.timed``): the others train without a time bias."""

    def __init__(self, split: LeaveOneOutSplit, max_seq_len: int, use_timestamps: bool) -> None:
        seqs = split.sequences
        users = np.flatnonzero(split.train_lengths >= 2)  # one target needs two items
        if len(users) == 0:
            raise EmptyDatasetError("no user has two training interactions", seqs.source)
        size = (len(users), max_seq_len)
        inputs, targets = np.zeros(size, np.int64), np.zeros(size, np.int64)
        stamps, target_stamps = np.zeros(size, np.int64), np.zeros(size, np.int64)
        lengths = np.zeros(len(users), np.int64)
        for row, user in enumerate(users):
            start = seqs.offsets[user]
            window = slice(max(start, start + split.train_lengths[user] - max_seq_len - 1),
                           start + split.train_lengths[user])
            seq, ts = seqs.items[window], seqs.timestamps[window]
            n = len(seq) - 1
            inputs[row, :n], targets[row, :n], stamps[row, :n] = seq[:-1], seq[1:], ts[:-1]
            target_stamps[row, :n] = ts[1:]
            lengths[row] = n
        self.inputs, self.targets = torch.from_numpy(inputs), torch.from_numpy(targets)
        self.timestamps = torch.from_numpy(stamps) if use_timestamps else None
        # the targets' times: each position's next event's (a ranking example's positive's)
        self._target_ts = torch.from_numpy(target_stamps) if use_timestamps else None
        self.lengths = torch.from_numpy(lengths)
        self.num_items = seqs.num_items
        timed = seqs.timed[users]
        self.timed = torch.from_numpy(timed) if use_timestamps and not timed.all() else None

    def __len__(self) -> int:
        return len(self.lengths)

    def epoch(self, order: BatchOrder, batch_size: int, gen: torch.Generator
              ) -> list[Tensor]:
        """Row indices of each batch of one epoch (consumes ``gen``)."""
        return order.batches(self.lengths, batch_size, gen)

    def batch(self, rows: Tensor) -> TrainBatch:
        width = int(self.lengths[rows].max())
        ts = None if self.timestamps is None else self.timestamps[rows, :width]
        query_ts = None if self._target_ts is None else \
            self._target_ts[rows, self.lengths[rows] - 1]
        timed = None if self.timed is None else self.timed[rows]
        return TrainBatch(self.inputs[rows, :width], self.targets[rows, :width], ts, query_ts,
                          timed)

    def rank_batch(self, rows: Tensor, num_users: int, num_negatives: int,
                   gen: torch.Generator) -> RankBatch:
        """Cut points for ``num_users`` random ``rows``: history before the cut, the item at it
        as the positive, then ``num_negatives`` uniform negatives (they may repeat the positive;
        the loss masks that). Timed, the positive's time is the query time (the request's)."""
        pick = rows[torch.randperm(len(rows), generator=gen)[:num_users]]
        lengths = self.lengths[pick]
        cuts = (torch.rand(len(pick), generator=gen) * lengths).long() + 1   # 1..length
        width = int(cuts.max())
        keep = torch.arange(width)[None, :] < cuts[:, None]
        history = self.inputs[pick, :width] * keep
        positives = self.targets[pick, cuts - 1]
        negatives = torch.randint(1, self.num_items + 1, (len(pick), num_negatives), generator=gen)
        ts = None if self.timestamps is None else self.timestamps[pick, :width] * keep
        query_ts = None if self._target_ts is None else self._target_ts[pick, cuts - 1]
        return RankBatch(history, torch.cat([positives[:, None], negatives], dim=1), ts,
                         query_ts, None if self.timed is None else self.timed[pick])
