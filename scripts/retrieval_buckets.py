"""Validation HR@10 of a retrieval run, split by a property of the held-out row (docs/retrieval.md).

    PYTHONPATH=src python scripts/retrieval_buckets.py RUN [RUN ...] [--seed S] [--by KIND]

``--by degree`` (the default): for each domain of each run, the share of validation rows whose
item has 0, 1-2, 3-9 or 10+ training interactions, and HR@10 of each scorer on each bucket.

``--by partner`` (pair runs): for each domain ``d`` (partner ``p``), how many items of ``d`` have
an item of ``p`` bought by exactly the same users (at least two: a product listed in both
catalogues looks like this) and how many one bought by mostly the same (Jaccard >= 0.5); then
HR@10 on the validation rows whose held-out item shares a training user with one of the user's
own ``p`` items ("linked"), with Jaccard >= 0.5 ("twin"), and on the rest.

``--by cold``: for each domain, how much likelier an item of each training-degree bucket is to
be the held-out item than a uniformly drawn catalogue item (share of validation rows / share of
items), and the HR@10 of popularity when the items with no training interaction are scored as if
they had K (an analysis of the protocol, not a scorer to serve: docs/retrieval.md, "What the
published figures' own code does").

Scorers: the run's model, popularity and (``--by partner``) item-CF; 99 or 999 sampled
negatives, the split's own. Validation rows only: the test rows stay unread.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from relaygr.retrieval.checkpoint import TrainedRetrieval, load_seed, read_run_info
from relaygr.retrieval.evaluate import PopularityScorer, Scorer, VectorScorer, sampled_ranks
from relaygr.retrieval.graph import BipartiteGraph, SharedUsers
from relaygr.retrieval.report import item_cf

BUCKETS = ((0, 0), (1, 2), (3, 9), (10, None))


def bucket_line(ranks: np.ndarray, degree: np.ndarray) -> str:
    hit = ranks < 10
    parts = [f"all {hit.mean():.3f}"]
    for lo, hi in BUCKETS:
        mask = (degree >= lo) & (degree <= (hi if hi is not None else degree.max()))
        label = f"{lo}+" if hi is None else (f"{lo}" if lo == hi else f"{lo}-{hi}")
        share = mask.mean()
        rate = f"{hit[mask].mean():.3f}" if mask.any() else "-"
        parts.append(f"deg {label} ({share:.2f}) {rate}")
    return " | ".join(parts)


def by_degree(run: Path, trained: TrainedRetrieval, scorers: dict[str, Scorer]) -> None:
    for domain, split in trained.splits.items():
        degree = np.bincount(split.train[:, 1], minlength=split.num_items)[split.valid[:, 1]]
        for name, scorer in scorers.items():
            ranks = sampled_ranks(scorer, domain, split.valid, split.valid_negatives)
            print(f"{run.name} {domain} {name}: {bucket_line(ranks, degree)}")


def by_partner(run: Path, trained: TrainedRetrieval, scorers: dict[str, Scorer],
               num_users: int) -> None:
    splits = trained.splits
    if len(splits) != 2:
        raise SystemExit(f"{run}: --by partner needs a pair run")
    graphs = {d: BipartiteGraph(num_users, s.num_items, s.train) for d, s in splits.items()}
    one, other = splits
    for d, p in ((one, other), (other, one)):
        pairs = SharedUsers.of(graphs[d], graphs[p])
        both = pairs.shared >= 2
        same = np.unique(pairs.target_items[both & (pairs.jaccard >= 1.0)])
        mostly = np.unique(pairs.target_items[both & (pairs.jaccard >= 0.5)])
        degree = np.bincount(splits[d].train[:, 1], minlength=splits[d].num_items)
        shared = pairs.matrix(pairs.shared).tocsc()
        jaccard = pairs.matrix(pairs.jaccard).tocsc()
        bought = graphs[p].interactions()
        valid = splits[d].valid
        linked = np.zeros(len(valid), bool)
        twin = np.zeros(len(valid), bool)
        for r, (u, i) in enumerate(valid):
            mine = bought.indices[bought.indptr[u]:bought.indptr[u + 1]]
            linked[r] = shared[:, i].toarray().ravel()[mine].sum() > 0
            twin[r] = linked[r] and jaccard[:, i].toarray().ravel()[mine].max() >= 0.5
        print(f"{run.name} {d} (partner {p}): {len(same)} of {int((degree >= 2).sum())} items "
              f"with >= 2 users have a {p} item with the same users, {len(mostly)} one with "
              f"Jaccard >= 0.5; validation rows {len(valid)}: linked {linked.mean():.3f}, "
              f"twin {twin.mean():.3f}")
        for name, scorer in scorers.items():
            hit = sampled_ranks(scorer, d, valid, splits[d].valid_negatives) < 10
            print(f"    HR@10 {name:>10}: all {hit.mean():.3f} | linked "
                  f"{hit[linked].mean():.3f} | not linked {hit[~linked].mean():.3f} | twin "
                  f"{hit[twin].mean():.3f}")


def by_cold(run: Path, trained: TrainedRetrieval) -> None:
    for domain, split in trained.splits.items():
        degree = np.bincount(split.train[:, 1], minlength=split.num_items)
        held = degree[split.valid[:, 1]]
        parts = []
        for lo, hi in BUCKETS:
            top = hi if hi is not None else degree.max()
            rows = ((held >= lo) & (held <= top)).mean()
            items = ((degree >= lo) & (degree <= top)).mean()
            label = f"{lo}+" if hi is None else (f"{lo}" if lo == hi else f"{lo}-{hi}")
            ratio = f"{rows / items:.2f}x" if items else "-"
            parts.append(f"deg {label}: {rows:.3f} of rows / {items:.3f} of items = {ratio}")
        print(f"{run.name} {domain}: " + " | ".join(parts))
        hits = []
        for as_if in (None, 1, 3, 10, 30):
            counts = degree.astype(np.float32)
            if as_if is not None:   # just under K, so that a tie never decides
                counts[degree == 0] = as_if - 0.5
            scorer = PopularityScorer({domain: counts})
            ranks = sampled_ranks(scorer, domain, split.valid, split.valid_negatives)
            name = "popularity" if as_if is None else f"unseen as {as_if}"
            hits.append(f"{name} {np.mean(ranks < 10):.4f}")
        print("    HR@10: " + " | ".join(hits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--by", choices=["degree", "partner", "cold"], default="degree")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run in args.runs:
        info = read_run_info(run)
        trained = load_seed(run, info, args.seed)
        model, splits = trained.model, trained.splits
        scorers: dict[str, Scorer] = {
            "model": VectorScorer({d: model.user_vectors(d) for d in splits},
                                  {d: model.item_vectors(d) for d in splits}),
            "popularity": PopularityScorer.of({d: s.train for d, s in splits.items()},
                                              {d: s.num_items for d, s in splits.items()}),
        }
        if args.by == "degree":
            by_degree(run, trained, scorers)
        elif args.by == "cold":
            by_cold(run, trained)
        else:
            by_partner(run, trained, {**scorers, "itemcf": item_cf(splits, info.num_users)},
                       info.num_users)


if __name__ == "__main__":
    main()
