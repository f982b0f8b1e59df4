"""``relaygr eval``: full-catalogue evaluation of a trained run on its held-out items.

    relaygr eval --checkpoint RUN_DIR --dataset ml-1m --data-dir DIR [--json PATH]
                 [--split test|valid] [--heads retrieval,ranking]

Every user's held-out item is ranked against the whole catalogue with the user's history
removed; HR@10/50/200, NDCG@10/50/200 and MRR are reported for the retrieval head, the ranking
head (the whole catalogue scored as candidates against each user's prefilled K/V: the relay
pattern, offline) and a popularity baseline. Without ``--checkpoint`` only the baseline runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from relaygr.cli.train import add_data_arguments, parse_columns
from relaygr.data import leave_one_out, load_sequences
from relaygr.errors import ConfigError
from relaygr.train import (
    CUTOFFS,
    RankingMetrics,
    load_trained,
    popularity_ranks,
    serving_ranks,
)

HEAD_CHOICES = ("retrieval", "ranking")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="evaluate a trained run (full-catalogue ranking)",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=None, help="run directory")
    add_data_arguments(parser)
    parser.add_argument("--split", choices=("test", "valid"), default="test")
    parser.add_argument("--heads", default=",".join(HEAD_CHOICES),
                        help="comma-separated heads to evaluate (retrieval, ranking)")
    parser.add_argument("--batch-users", type=int, default=8,
                        help="users prefilled and ranked together")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def _heads(text: str) -> tuple[str, ...]:
    heads = tuple(h for h in text.split(",") if h)
    if not heads or set(heads) - set(HEAD_CHOICES):
        raise ConfigError(f"--heads takes a comma-separated subset of {HEAD_CHOICES}")
    return heads


def _table(results: dict[str, RankingMetrics], title: str) -> Table:
    table = Table(title=title)
    table.add_column("head", no_wrap=True)
    columns = [f"HR@{k}" for k in CUTOFFS] + [f"NDCG@{k}" for k in CUTOFFS] + ["MRR"]
    for column in columns:
        table.add_column(column, justify="right")
    for head, m in results.items():
        values = [m.hr[k] for k in CUTOFFS] + [m.ndcg[k] for k in CUTOFFS] + [m.mrr]
        table.add_row(head, *(f"{v:.4f}" for v in values))
    return table


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    heads = _heads(args.heads)
    trained = None if args.checkpoint is None else load_trained(args.checkpoint, args.device)
    id_map = None if trained is None else trained.id_map
    seqs = load_sequences(args.dataset, args.data_dir, parse_columns(args.columns), id_map)
    split = leave_one_out(seqs)
    cases = split.test if args.split == "test" else split.valid
    results: dict[str, RankingMetrics] = {}
    seconds: dict[str, float] = {}
    if trained is not None:
        info = trained.run.dataset
        if (info.num_users, info.num_events) != (seqs.num_users, seqs.num_events):
            print(f"note: trained on {info.num_users} users / {info.num_events} interactions, "
                  f"evaluating on {seqs.num_users} / {seqs.num_events}")
        started = time.perf_counter()
        ranks = serving_ranks(trained.model, seqs, cases, trained.model.cfg.max_seq_len,
                              trained.uses_timestamps, heads, args.batch_users,
                              progress=not args.no_progress)
        seconds["model"] = time.perf_counter() - started
        results.update({h: RankingMetrics.from_ranks(r) for h, r in ranks.items()})
    started = time.perf_counter()
    results["popularity"] = RankingMetrics.from_ranks(popularity_ranks(split, cases))
    seconds["popularity"] = time.perf_counter() - started
    title = f"{args.dataset} {args.split}: {len(cases)} users, {seqs.num_items} items"
    Console().print(_table(results, title))
    print("evaluation time: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_report(args, results, seconds, len(cases)), indent=2))
    return 0


def _report(args: argparse.Namespace, results: dict[str, RankingMetrics],
            seconds: dict[str, float], num_cases: int) -> dict[str, Any]:
    return {"checkpoint": None if args.checkpoint is None else str(args.checkpoint),
            "dataset": args.dataset, "data_dir": str(args.data_dir), "split": args.split,
            "num_cases": num_cases, "heads": {h: m.to_dict() for h, m in results.items()},
            "seconds": seconds, "machine": {"platform": platform.platform(),
                                            "torch_threads": torch.get_num_threads(),
                                            "device": args.device}}
