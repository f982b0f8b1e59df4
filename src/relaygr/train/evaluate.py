"""Full-catalogue evaluation of held-out items: the retrieval head, the ranking head, popularity.

Each case (``EvalCases``) is a user's history and the item that followed it. The model reads the
last ``max_seq_len`` items of the history; every item of the whole history is removed from the
recommendations (``metrics.target_ranks``).

* ``retrieval_ranks_padded``: ``encode_padded`` in batches: the fast path validation uses.
* ``serving_ranks``: the relay pattern offline: ``prefill`` each history once, then the retrieval
  head scores ``PrefixKV.last_hidden`` and the ranking head scores the whole catalogue as
  candidates against the cached prefix with ``rank_batch`` (micro-batched inside the model).
  Both heads are therefore measured through the exact functions a server runs.
* ``popularity_ranks``: the baseline: items by training-interaction count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from relaygr.data.sequences import UserSequences
from relaygr.data.split import EvalCases, LeaveOneOutSplit
from relaygr.model import HSTU, PrefillRequest, RankRequest
from relaygr.train.metrics import target_ranks

HEADS = ("retrieval", "ranking")


@dataclass(frozen=True)
class CaseWindow:
    """What the model reads for a slice of cases: ``items`` ``[b, T]`` right-padded with 0,
    ``timestamps`` likewise or None, ``lengths`` ``[b]``, and the full ``histories`` to mask."""

    items: Tensor
    timestamps: Tensor | None
    lengths: Tensor
    histories: list[np.ndarray]
    targets: Tensor


def case_windows(seqs: UserSequences, cases: EvalCases, rows: np.ndarray, max_seq_len: int,
                 use_timestamps: bool) -> CaseWindow:
    histories = [seqs.sequence(u)[:n] for u, n in zip(cases.users[rows],
                                                      cases.history_lengths[rows], strict=True)]
    lengths = [min(len(h), max_seq_len) for h in histories]
    items = np.zeros((len(rows), max(lengths)), dtype=np.int64)
    stamps = np.zeros_like(items)
    for j, (user, hist) in enumerate(zip(cases.users[rows], histories, strict=True)):
        start = seqs.offsets[user] + len(hist) - lengths[j]
        items[j, :lengths[j]] = hist[-lengths[j]:]
        stamps[j, :lengths[j]] = seqs.timestamps[start:start + lengths[j]]
    return CaseWindow(torch.from_numpy(items), torch.from_numpy(stamps) if use_timestamps else None,
                      torch.tensor(lengths), histories, torch.from_numpy(cases.targets[rows]))


def _chunks(num: int, size: int, label: str, progress: bool) -> Iterable[np.ndarray]:
    starts = range(0, num, size)
    bar = tqdm(starts, desc=label, unit="batch", disable=not progress, leave=False,
               mininterval=5.0)
    for start in bar:
        yield np.arange(start, min(start + size, num))


@torch.inference_mode()
def retrieval_ranks_padded(model: HSTU, seqs: UserSequences, cases: EvalCases, max_seq_len: int,
                           use_timestamps: bool, batch_size: int = 256,
                           progress: bool = False) -> Tensor:
    """Ranks of the retrieval head computed with ``encode_padded`` (model put in eval mode)."""
    model.eval()
    # cases in order of length, so each batch is padded to about its own width
    by_length = np.argsort(np.minimum(cases.history_lengths, max_seq_len), kind="stable")
    ranks = torch.empty(len(cases), dtype=torch.long)
    for chunk in _chunks(len(cases), batch_size, "validate", progress):
        rows = by_length[chunk]
        w = case_windows(seqs, cases, rows, max_seq_len, use_timestamps)
        ts = None if w.timestamps is None else w.timestamps.to(model.device)
        hidden = model.encode_padded(w.items.to(model.device), ts)
        last = hidden[torch.arange(len(rows)), w.lengths.to(model.device) - 1]   # [b, d]
        ranks[torch.from_numpy(rows)] = target_ranks(model.retrieval_scores(last), w.targets,
                                                     w.histories)
    return ranks


@torch.inference_mode()
def serving_ranks(model: HSTU, seqs: UserSequences, cases: EvalCases, max_seq_len: int,
                  use_timestamps: bool, heads: tuple[str, ...] = HEADS, batch_users: int = 8,
                  progress: bool = False) -> dict[str, Tensor]:
    """Ranks of each head in ``heads`` through ``prefill`` / ``rank`` (see the module doc)."""
    model.eval()
    catalogue = torch.arange(1, model.cfg.num_items + 1, device=model.device)
    ranks: dict[str, list[Tensor]] = {h: [] for h in heads}
    for rows in _chunks(len(cases), batch_users, "evaluate", progress):
        w = case_windows(seqs, cases, rows, max_seq_len, use_timestamps)
        prefills = []
        for j, n in enumerate(w.lengths.tolist()):
            ts = None if w.timestamps is None else w.timestamps[j, :n]
            prefills.append(PrefillRequest(w.items[j, :n].to(model.device), ts))
        prefixes = model.prefill_batch(prefills)
        if "retrieval" in heads:
            users = torch.stack([kv.last_hidden for kv in prefixes])              # [b, d]
            ranks["retrieval"].append(
                target_ranks(model.retrieval_scores(users), w.targets, w.histories))
        if "ranking" in heads:
            scores = model.rank_batch([RankRequest(catalogue, prefix=kv) for kv in prefixes])
            padded = torch.nn.functional.pad(torch.stack(scores), (1, 0))      # [b, N + 1]
            ranks["ranking"].append(target_ranks(padded, w.targets, w.histories))
    return {h: torch.cat(r) for h, r in ranks.items()}


def popularity_ranks(split: LeaveOneOutSplit, cases: EvalCases) -> Tensor:
    """Ranks when every user is recommended the most-interacted items of the training data."""
    seqs = split.sequences
    train_items = np.concatenate([seqs.sequence(u)[:n] for u, n in
                                  enumerate(split.train_lengths)])
    counts = np.bincount(train_items, minlength=seqs.num_items + 1).astype(np.float32)
    histories = [seqs.sequence(u)[:n] for u, n in zip(cases.users, cases.history_lengths,
                                                      strict=True)]
    scores = torch.from_numpy(counts)[None].expand(len(cases), -1)
    return target_ranks(scores, torch.from_numpy(cases.targets), histories)
