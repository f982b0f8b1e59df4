"""``relaygr demo``: one user's relay in miniature.

Builds a model, pre-infers a long prefix, ranks candidates from the cached prefix and from a full
pass, and prints both latencies and the largest score difference between them.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from relaygr.cli.config import device_name
from relaygr.model import HSTU, MODEL_SIZES, config_for_size
from relaygr.timing import time_call

DEMO_NUM_ITEMS = 100_000


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="pre-infer a prefix, rank from cache and from a full pass",
                       description=__doc__)
    p.add_argument("--size", choices=sorted(MODEL_SIZES), default="small")
    p.add_argument("--prefix", type=int, default=4096, help="prefix (long-term history) tokens")
    p.add_argument("--suffix", type=int, default=16, help="recent-behaviour tokens")
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--device", type=device_name,
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 100))
    device = torch.device(args.device)
    cfg = config_for_size(args.size, DEMO_NUM_ITEMS, max_seq_len=args.prefix + args.suffix)
    torch.manual_seed(args.seed)
    model = HSTU(cfg).to(device).eval()
    gen = torch.Generator().manual_seed(args.seed)
    n = args.prefix + args.suffix
    items = torch.randint(1, DEMO_NUM_ITEMS + 1, (n,), generator=gen)
    ts = 1_700_000_000 + torch.cumsum(torch.randint(1, 3600, (n,), generator=gen), 0)
    cands = torch.randint(1, DEMO_NUM_ITEMS + 1, (args.candidates,), generator=gen)
    prefix, prefix_ts = items[:args.prefix], ts[:args.prefix]
    suffix, suffix_ts = items[args.prefix:], ts[args.prefix:]
    query_ts = int(ts[-1]) + 30

    def prefill() -> object:
        return model.prefill(prefix, prefix_ts)

    kv = model.prefill(prefix, prefix_ts)

    def cached() -> torch.Tensor:
        return model.rank(cands, prefix=kv, suffix_items=suffix, suffix_timestamps=suffix_ts,
                          query_timestamp=query_ts)

    def full() -> torch.Tensor:
        return model.rank(cands, prefix_items=prefix, prefix_timestamps=prefix_ts,
                          suffix_items=suffix, suffix_timestamps=suffix_ts,
                          query_timestamp=query_ts)

    t_prefill = time_call(prefill, device, args.repeats)
    t_full = time_call(full, device, args.repeats)
    t_cached = time_call(cached, device, args.repeats)
    diff = (cached() - full()).abs().max().item()

    table = Table(title=(f"relay demo: {cfg.num_layers} layers, dim {cfg.dim}, {cfg.num_heads} "
                         f"heads on {device}; prefix {args.prefix} + suffix {args.suffix} "
                         f"tokens, {args.candidates} candidates"))
    table.add_column("path")
    table.add_column("median ms", justify="right")
    table.add_column("what it computes")
    table.add_row("pre-infer (prefill)", f"{t_prefill.median_ms:.1f}",
                  "prefix K/V, off the ranking critical path")
    table.add_row("ranking, full pass", f"{t_full.median_ms:.1f}",
                  "prefix + suffix + candidates (today's production)")
    table.add_row("ranking, relayed", f"{t_cached.median_ms:.1f}",
                  "suffix + candidates against the cached prefix")
    console.print(table)
    console.print(f"speedup of ranking: {t_full.median_ms / t_cached.median_ms:.1f}x; "
                  f"max |score difference| cached vs full: {diff:.2e}")
    return 0
