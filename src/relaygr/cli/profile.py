"""``relaygr profile``: latency of prefill, full and cached ranking against prefix length."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from relaygr.bench.profile import ProfileConfig, ProfileResult, run_profile
from relaygr.cli.config import check_output_file, device_name, positive_int
from relaygr.cli.train import parse_overrides
from relaygr.engine.hostmem import tune_host_allocator
from relaygr.model import MODEL_SIZES


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError as exc:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="model-only latency table (feeds the trigger's cost model)",
                       description=__doc__)
    p.add_argument("--size", choices=sorted(MODEL_SIZES), default="small")
    p.add_argument("--lengths", type=_ints, default=ProfileConfig.prefix_lengths,
                   help="prefix lengths, comma-separated (default 256..8192)")
    p.add_argument("--candidates", type=_ints, default=ProfileConfig.candidate_counts)
    p.add_argument("--suffix", type=int, default=0, help="suffix tokens per ranking request")
    p.add_argument("--timestamps", action="store_true",
                   help="give histories and queries timestamps (every pass adds the time bias)")
    p.add_argument("--time-bias-rounds", type=int, default=0, metavar="N",
                   help="also time every pass with and without timestamps in alternation, N "
                        "rounds, and report what the time bias costs as their ratio (0: not)")
    p.add_argument("--device", type=device_name,
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per point (median)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override an HSTUConfig field of the size (repeatable), e.g. "
                        "query_block=4096")
    p.add_argument("--json", type=Path, default=Path("out/profile.json"))
    p.set_defaults(func=run)


def render(result: ProfileResult) -> Table:
    peak = result.matmul_peak_gflops
    timed = "with timestamps" if result.config.timestamps else "no timestamps"
    table = Table(title=(f"relaygr profile: {result.model['num_layers']} layers, dim "
                         f"{result.model['dim']}, {result.model['num_heads']} heads on "
                         f"{result.device} ({result.dtype}, {result.threads} threads, {timed}); "
                         f"matmul peak {peak:.0f} GFLOP/s, element-wise "
                         f"{result.elementwise_gelems:.2f} G scores/s; attention "
                         f"{result.attention}"))
    for name in ("prefix", "cands", "prefill ms", "full ms", "cached ms", "speedup",
                 "prefill %peak", "full %peak", "cached %peak", "cached limit ms",
                 "cached % of limit", "cached faults"):
        table.add_column(name, justify="right")
    for p in result.points:
        table.add_row(str(p.prefix_tokens), str(p.candidates), f"{p.prefill_ms:.1f}",
                      f"{p.full_rank_ms:.1f}", f"{p.cached_rank_ms:.2f}", f"{p.speedup:.1f}x",
                      f"{100 * p.prefill_gflops / peak:.0f}%",
                      f"{100 * p.full_rank_gflops / peak:.0f}%",
                      f"{100 * p.cached_rank_gflops / peak:.0f}%",
                      f"{p.cached_rank_limit_ms:.2f}",
                      f"{100 * p.cached_rank_limit_ms / p.cached_rank_ms:.0f}%",
                      f"{p.cached_rank_page_faults:.0f}")
    return table


def render_limits(result: ProfileResult) -> Table:
    """Each pass of each point beside its work and the limit that work sets on this device."""
    table = Table(title=("each pass against this device's limit: its matrix FLOPs at the matmul "
                         f"peak ({result.matmul_peak_gflops:.0f} GFLOP/s) plus its attention "
                         f"scores at the element-wise rate ({result.elementwise_gelems:.2f} G/s)"))
    for name in ("prefix", "cands", "pass", "ms", "matrix GFLOP", "scores (M)", "% of peak",
                 "limit ms", "% of limit", "matmul share of limit"):
        table.add_column(name, justify="right")
    for p in result.points:
        for name, ms, flops, scores, limit in (
                ("prefill", p.prefill_ms, p.prefill_flops, p.prefill_scores, p.prefill_limit_ms),
                ("full", p.full_rank_ms, p.full_rank_flops, p.full_rank_scores,
                 p.full_rank_limit_ms),
                ("cached", p.cached_rank_ms, p.cached_rank_flops, p.cached_rank_scores,
                 p.cached_rank_limit_ms)):
            matmul_ms = flops / (result.matmul_peak_gflops * 1e6)
            table.add_row(str(p.prefix_tokens), str(p.candidates), name, f"{ms:.1f}",
                          f"{flops / 1e9:.2f}", f"{scores / 1e6:.1f}",
                          f"{100 * matmul_ms / ms:.0f}%", f"{limit:.1f}",
                          f"{100 * limit / ms:.0f}%", f"{100 * matmul_ms / limit:.0f}%")
    return table


def render_time_bias(result: ProfileResult) -> Table:
    """What the time bias costs each pass: with timestamps over without, timed in alternation."""
    rounds = result.time_bias[0].rounds
    table = Table(title=("the time bias's cost: each pass with timestamps against without, timed "
                         f"in alternation in this process ({rounds} rounds): medians, and the "
                         "median ratio with its range over the rounds"))
    for name in ("prefix", "cands", "pass", "plain ms", "timestamps ms", "ratio", "range"):
        table.add_column(name, justify="right")
    for c in result.time_bias:
        table.add_row(str(c.prefix_tokens), str(c.candidates), c.path, f"{c.plain_ms:.1f}",
                      f"{c.timed_ms:.1f}", f"{c.ratio:.2f}x",
                      f"[{c.ratio_min:.2f}, {c.ratio_max:.2f}]")
    return table


def run(args: argparse.Namespace) -> int:
    check_output_file(args.json)
    tune_host_allocator()  # the table must match what a serving process sees
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ProfileConfig(size=args.size, prefix_lengths=args.lengths,
                        candidate_counts=args.candidates, suffix_tokens=args.suffix,
                        device=args.device, dtype=args.dtype, repeats=args.repeats,
                        timestamps=args.timestamps, time_bias_rounds=args.time_bias_rounds,
                        model_overrides=parse_overrides(args.overrides))
    console = Console(width=max(Console().width, 150))
    with Progress(console=console, transient=True) as progress:
        result = run_profile(cfg, progress)
    console.print(render(result))
    console.print(render_limits(result))
    if result.time_bias:
        console.print(render_time_bias(result))
    result.write_json(args.json)
    console.print(f"wrote {args.json}")
    return 0
