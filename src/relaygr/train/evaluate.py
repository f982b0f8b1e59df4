"""Full-catalogue evaluation of held-out items: the retrieval head, the ranking head, the
cascade of the two, popularity.

Each case (``EvalCases``) is a user's history and the item that followed it. The model reads the
last ``max_seq_len`` items of the history (its window). What is removed from the recommendations
(``metrics.target_ranks``) is ``exclude``'s choice (``EXCLUSIONS``): ``"history"``, every item of
the whole history, as serving removes what a user has seen; ``"window"``, only the items of the
window, the protocol of the HSTU paper's open-source evaluation (its ``past_ids``), under which
its published figures were measured. Removing more items that are not the target can only raise
its rank, so ``"history"`` ranks each target at least as high as ``"window"``; the two agree for
every user whose history fits the window.

* ``retrieval_ranks_padded``: ``encode_padded`` in batches: the fast path validation uses.
* ``serving_ranks``: the relay pattern offline: ``prefill`` each history once, then the retrieval
  head scores ``PrefixKV.last_hidden`` and the ranking head scores the whole catalogue as
  candidates against the cached prefix with ``rank_batch`` (micro-batched inside the model).
  Both heads are therefore measured through the exact functions a server runs.
* the cascade (``serving_ranks`` too): a retrieval stage (``stages``; the model's own retrieval
  head by default) proposes its top K unseen items, the ranking head scores those K against the
  cached prefix (``rank_batch``), optionally plus a weight times the stage's score (``fuse``),
  and the result is ranked over the whole catalogue with every item retrieval did not propose
  below the K (``cascade_ranks``): production's two stages. Beside it, ``"stage"``: the stage
  alone, the figure the cascade is compared with.
* ``popularity_ranks``: the baseline: items by training-interaction count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from relaygr.data.sequences import UserSequences
from relaygr.data.split import EvalCases, LeaveOneOutSplit
from relaygr.errors import ConfigError
from relaygr.model import HSTU, PrefillInput, PrefixKV, RankInput
from relaygr.train.metrics import target_ranks
from relaygr.train.stages import (
    HeadRetrieval,
    Proposals,
    RetrievalQuery,
    RetrievalStage,
    fused_scores,
)

HEADS = ("retrieval", "ranking", "cascade")
# Items the cascade's retrieval stage proposes by default: the relay's ranking request size.
DEFAULT_RETRIEVE_K = 200
# What a recommendation may not contain (module docstring): the whole history, or the window.
EXCLUSIONS = ("history", "window")


def check_exclude(exclude: str) -> None:
    if exclude not in EXCLUSIONS:
        raise ConfigError(f"exclude must be one of {EXCLUSIONS}, got {exclude!r}")


def excluded_items(history: np.ndarray, exclude: str, max_seq_len: int) -> np.ndarray:
    """The items of ``history`` a recommendation may not contain (``EXCLUSIONS``)."""
    return history if exclude == "history" else history[-max_seq_len:]


@dataclass(frozen=True)
class CaseWindow:
    """What the model reads for a slice of cases: ``items`` ``[b, T]`` right-padded with 0,
    ``timestamps`` likewise or None, ``lengths`` ``[b]``; the full ``histories`` (what a
    retrieval stage reads and never proposes) and the items ``excluded`` from the ranking (the
    histories, or their windows: ``EXCLUSIONS``). ``request_timestamps`` ``[b]`` (timed, else
    None): each case's held-out event's time, the request time at which it is queried
    (``HSTU.encode_padded``'s query times) and the ranking head scores candidates
    (``request_times``); ``timed`` ``[b]`` bool, which cases' users carry time, where only some
    do (``TrainConfig.time_where_known``; else None)."""

    items: Tensor
    timestamps: Tensor | None
    lengths: Tensor
    histories: list[np.ndarray]
    targets: Tensor
    excluded: list[np.ndarray]
    request_timestamps: Tensor | None = None
    timed: Tensor | None = None

    def is_timed(self, j: int) -> bool:
        """Whether case ``j``'s history is read with its timestamps."""
        return self.timestamps is not None and (self.timed is None or bool(self.timed[j]))


def case_windows(seqs: UserSequences, cases: EvalCases, rows: np.ndarray, max_seq_len: int,
                 use_timestamps: bool, exclude: str = "history") -> CaseWindow:
    """The windows of ``cases[rows]``."""
    check_exclude(exclude)
    histories = [seqs.sequence(u)[:n] for u, n in zip(cases.users[rows],
                                                      cases.history_lengths[rows], strict=True)]
    lengths = [min(len(h), max_seq_len) for h in histories]
    items = np.zeros((len(rows), max(lengths)), dtype=np.int64)
    stamps = np.zeros_like(items)
    request = np.zeros(len(rows), dtype=np.int64)
    for j, (user, hist) in enumerate(zip(cases.users[rows], histories, strict=True)):
        start = seqs.offsets[user] + len(hist) - lengths[j]
        items[j, :lengths[j]] = hist[-lengths[j]:]
        stamps[j, :lengths[j]] = seqs.timestamps[start:start + lengths[j]]
        if use_timestamps:   # the held-out event's, after the history (else the last one's)
            after = seqs.offsets[user] + len(hist)
            request[j] = seqs.timestamps[min(after, seqs.offsets[user + 1] - 1)]
    excluded = [excluded_items(h, exclude, max_seq_len) for h in histories]
    timed = use_timestamps
    users_timed = seqs.timed[cases.users[rows]]
    return CaseWindow(torch.from_numpy(items), torch.from_numpy(stamps) if timed else None,
                      torch.tensor(lengths), histories, torch.from_numpy(cases.targets[rows]),
                      excluded, torch.from_numpy(request) if timed else None,
                      torch.from_numpy(users_timed) if timed and not users_timed.all() else None)


def _chunks(num: int, size: int, label: str, progress: bool) -> Iterable[np.ndarray]:
    starts = range(0, num, size)
    bar = tqdm(starts, desc=label, unit="batch", disable=not progress, leave=False,
               mininterval=5.0)
    for start in bar:
        yield np.arange(start, min(start + size, num))


@torch.inference_mode()
def retrieval_ranks_padded(model: HSTU, seqs: UserSequences, cases: EvalCases, max_seq_len: int,
                           use_timestamps: bool, batch_size: int = 256,
                           progress: bool = False, exclude: str = "history") -> Tensor:
    """Ranks of the retrieval head computed with ``encode_padded`` (model put in eval mode),
    ``exclude`` removed (``EXCLUSIONS``). A timed model with ``time_query="next"`` reads each
    case's target time as the request time (``case_windows``), as the open-source HSTU's
    evaluation does."""
    model.eval()
    # cases in order of length, so each batch is padded to about its own width
    by_length = np.argsort(np.minimum(cases.history_lengths, max_seq_len), kind="stable")
    ranks = torch.empty(len(cases), dtype=torch.long)
    for chunk in _chunks(len(cases), batch_size, "validate", progress):
        rows = by_length[chunk]
        w = case_windows(seqs, cases, rows, max_seq_len, use_timestamps, exclude)
        ts, request_ts, timed = (None if t is None else t.to(model.device)
                                 for t in (w.timestamps, w.request_timestamps, w.timed))
        hidden = model.encode_padded(w.items.to(model.device), ts, request_ts, timed)
        last = hidden[torch.arange(len(rows)), w.lengths.to(model.device) - 1]   # [b, d]
        ranks[torch.from_numpy(rows)] = target_ranks(model.retrieval_scores(last), w.targets,
                                                     w.excluded)
    return ranks


@dataclass(frozen=True)
class CascadeSpec:
    """The cascade head's retrieval stage, how many items it proposes (``retrieve_k``), and the
    weight of the stage's own score in the final one (``stage_weight``): a proposal is ranked by
    ``ranker score + stage_weight x stage score``, the retrieval score as an input of the
    ranking stage, as production rankers take it. 0 ranks by the ranker alone."""

    stage: RetrievalStage
    retrieve_k: int = DEFAULT_RETRIEVE_K
    stage_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.retrieve_k <= 0:
            raise ConfigError(f"retrieve-k must be positive, got {self.retrieve_k}")
        if not (math.isfinite(self.stage_weight) and self.stage_weight >= 0):
            raise ConfigError(f"the stage weight must be finite and >= 0, got {self.stage_weight}")


def fuse(proposals: Proposals, ranked: Sequence[Tensor], stage_weight: float) -> list[Tensor]:
    """The final score of each user's proposals: the ranker's plus ``stage_weight`` x the
    stage's (``CascadeSpec``); the ranker's scores alone when the weight is 0."""
    return [fused_scores(r, proposals.row(j)[1], stage_weight) for j, r in enumerate(ranked)]


def cascade_ranks(proposals: Proposals, ranked: Sequence[Tensor], targets: Tensor,
                  histories: Sequence[np.ndarray], num_items: int) -> Tensor:
    """Ranks over the whole catalogue of a cascade: the proposed items in the order of their
    ranking ``ranked[j]`` (scores of ``proposals.row(j)``'s items), above every item not
    proposed. Those all tie at ``-inf`` and ties count against the target, so a target the
    retrieval stage missed ranks below all K (rank >= K): a miss at every cutoff <= K."""
    full = torch.full((len(ranked), num_items + 1), -math.inf)
    for j, scores in enumerate(ranked):
        items, _ = proposals.row(j)
        full[j, items.cpu()] = scores.float().cpu()
    return target_ranks(full, targets, histories)


def request_times(w: CaseWindow) -> list[int | None]:
    """Each case's request time: the held-out event's timestamp (None untimed), at which the
    ranking head scores candidates, as serving does at the request's."""
    if w.request_timestamps is None:
        return [None] * len(w.lengths)
    return [int(t) if w.is_timed(j) else None
            for j, t in enumerate(w.request_timestamps.tolist())]


def _ranked_by_model(model: HSTU, prefixes: Sequence[PrefixKV], proposals: Proposals,
                     times: Sequence[int | None]) -> list[Tensor]:
    """The relay path: each user's proposals scored as candidates against its cached prefix,
    at its request time."""
    requests = [RankInput(proposals.row(j)[0], prefix=kv, query_timestamp=times[j])
                for j, kv in enumerate(prefixes)]
    return model.rank_batch(requests)


def prefilled_batches(model: HSTU, seqs: UserSequences, cases: EvalCases, max_seq_len: int,
                      use_timestamps: bool, batch_users: int, progress: bool,
                      exclude: str = "history"
                      ) -> Iterator[tuple[np.ndarray, CaseWindow, list[PrefixKV]]]:
    """``(rows, window, prefixes)`` for consecutive slices of ``batch_users`` cases: what the
    model reads for them and its ``prefill`` of it (the relay's cached prefix)."""
    for rows in _chunks(len(cases), batch_users, "evaluate", progress):
        w = case_windows(seqs, cases, rows, max_seq_len, use_timestamps, exclude)
        prefills = []
        # under time_query="next" each prefix is computed for its request, at the target's time
        times = request_times(w) if model.cfg.next_time_query else [None] * len(rows)
        for j, n in enumerate(w.lengths.tolist()):
            ts = w.timestamps[j, :n] if w.timestamps is not None and w.is_timed(j) else None
            prefills.append(PrefillInput(w.items[j, :n].to(model.device), ts,
                                         next_timestamp=times[j]))
        yield rows, w, model.prefill_batch(prefills)


def ranked_proposals(model: HSTU, cases: EvalCases, rows: np.ndarray, w: CaseWindow,
                     prefixes: Sequence[PrefixKV], cascade: CascadeSpec
                     ) -> tuple[Proposals, list[Tensor]]:
    """The cascade for one slice: the stage's proposals and the ranker's scores of them
    (candidates against the cached prefix), before fusion."""
    query = RetrievalQuery(cases.users[rows], w.histories, prefixes)
    proposals = cascade.stage.propose(query, cascade.retrieve_k)
    return proposals, _ranked_by_model(model, prefixes, proposals, request_times(w))


@torch.inference_mode()
def serving_ranks(model: HSTU, seqs: UserSequences, cases: EvalCases, max_seq_len: int,
                  use_timestamps: bool, heads: tuple[str, ...] = HEADS, batch_users: int = 8,
                  progress: bool = False, cascade: CascadeSpec | None = None,
                  exclude: str = "history") -> dict[str, Tensor]:
    """Ranks of each head in ``heads`` through ``prefill`` / ``rank`` (see the module doc),
    ``exclude`` removed (``EXCLUSIONS``). ``cascade`` (default: the model's own retrieval head,
    K = 200, the ranker's score alone) sets the cascade head's retrieval stage; with the
    cascade comes ``"stage"``: the stage alone, its K proposals in its own order (at cutoffs
    <= K, the stage's own ranking), the figure the cascade must beat. The cascade is measured
    as served, its stage never proposing a seen item: with the whole history removed only."""
    check_exclude(exclude)
    if "cascade" in heads and exclude != "history":
        raise ConfigError("the cascade removes the whole history, as serving does (its stage "
                          "never proposes a seen item); evaluate it with exclude='history'")
    model.eval()
    if "cascade" in heads and cascade is None:
        cascade = CascadeSpec(HeadRetrieval(model))
    catalogue = torch.arange(1, model.cfg.num_items + 1, device=model.device)
    ranks: dict[str, list[Tensor]] = {h: [] for h in heads}
    for rows, w, prefixes in prefilled_batches(model, seqs, cases, max_seq_len, use_timestamps,
                                               batch_users, progress, exclude):
        if "retrieval" in heads:
            users = torch.stack([kv.last_hidden for kv in prefixes])              # [b, d]
            ranks["retrieval"].append(
                target_ranks(model.retrieval_scores(users), w.targets, w.excluded))
        if "ranking" in heads:
            scores = model.rank_batch([RankInput(catalogue, prefix=kv, query_timestamp=t)
                                       for kv, t in zip(prefixes, request_times(w), strict=True)])
            padded = torch.nn.functional.pad(torch.stack(scores), (1, 0))      # [b, N + 1]
            ranks["ranking"].append(target_ranks(padded, w.targets, w.excluded))
        if cascade is not None and "cascade" in heads:
            proposals, ranked = ranked_proposals(model, cases, rows, w, prefixes, cascade)
            ranks.setdefault("stage", []).append(cascade_ranks(
                proposals, [proposals.row(j)[1] for j in range(len(rows))], w.targets,
                w.excluded, model.cfg.num_items))
            ranks["cascade"].append(cascade_ranks(
                proposals, fuse(proposals, ranked, cascade.stage_weight), w.targets,
                w.excluded, model.cfg.num_items))
    return {h: torch.cat(r) for h, r in ranks.items()}


def subset_cases(cases: EvalCases, num_users: int, seed: int) -> EvalCases:
    """``num_users`` seeded-random cases of ``cases`` (in their original order), or all of them
    when ``num_users`` is at least their number: a cheaper evaluation for ablations."""
    if num_users <= 0:
        raise ConfigError(f"the number of evaluated users must be positive, got {num_users}")
    if num_users >= len(cases):
        return cases
    keep = np.sort(np.random.default_rng(seed).choice(len(cases), num_users, replace=False))
    return EvalCases(users=cases.users[keep], history_lengths=cases.history_lengths[keep],
                     targets=cases.targets[keep])


def popularity_ranks(split: LeaveOneOutSplit, cases: EvalCases, exclude: str = "history",
                     max_seq_len: int | None = None) -> Tensor:
    """Ranks when every user is recommended the most-interacted items of the training data,
    ``exclude`` removed (``EXCLUSIONS``; ``"window"``: the last ``max_seq_len`` items of each
    history, the window of the model it is compared with)."""
    check_exclude(exclude)
    if exclude == "window" and (max_seq_len is None or max_seq_len <= 0):
        raise ConfigError("popularity with the window removed needs the window's length "
                          f"(max_seq_len > 0), got {max_seq_len}")
    seqs = split.sequences
    train_items = np.concatenate([seqs.sequence(u)[:n] for u, n in
                                  enumerate(split.train_lengths)])
    counts = np.bincount(train_items, minlength=seqs.num_items + 1).astype(np.float32)
    excluded = [excluded_items(seqs.sequence(u)[:n], exclude, max_seq_len or 0)
                for u, n in zip(cases.users, cases.history_lengths, strict=True)]
    scores = torch.from_numpy(counts)[None].expand(len(cases), -1)
    return target_ranks(scores, torch.from_numpy(cases.targets), excluded)
