"""Validation HR@10 of a retrieval run by the held-out item's training degree (docs/retrieval.md).

    PYTHONPATH=src python scripts/retrieval_buckets.py RUN [RUN ...] [--seed 0]

For each domain of each run: the share of validation rows whose item has 0, 1-2, 3-9 or 10+
training interactions, and HR@10 (99 or 999 sampled negatives, the split's own) of the run's
model and of popularity on each bucket. Validation rows only: the test rows stay unread.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from relaygr.retrieval.checkpoint import load_seed, read_run_info
from relaygr.retrieval.evaluate import PopularityScorer, Scorer, VectorScorer, sampled_ranks

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run in args.runs:
        trained = load_seed(run, read_run_info(run), args.seed)
        model, splits = trained.model, trained.splits
        scorers: dict[str, Scorer] = {
            "model": VectorScorer({d: model.user_vectors(d) for d in splits},
                                  {d: model.item_vectors(d) for d in splits}),
            "popularity": PopularityScorer.of({d: s.train for d, s in splits.items()},
                                              {d: s.num_items for d, s in splits.items()}),
        }
        for domain, split in splits.items():
            degree = np.bincount(split.train[:, 1], minlength=split.num_items)[split.valid[:, 1]]
            for name, scorer in scorers.items():
                ranks = sampled_ranks(scorer, domain, split.valid, split.valid_negatives)
                print(f"{run.name} {domain} {name}: {bucket_line(ranks, degree)}")


if __name__ == "__main__":
    main()
