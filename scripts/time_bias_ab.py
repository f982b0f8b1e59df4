"""One history block's attention with and without the time bias, the kernels side by side.

What the time bias (rab^t, a per-layer table gathered by time bucket) costs a serving pass,
and whether computing it around the fused kernel's tiles pays. One block of ``--queries``
queries over ``--keys`` keys (4 heads of 32, as the `small` size), the time buckets of
increasing timestamps, rounds alternating the variants in this process (the order rotates
each round); prints each variant's median ms and its median paired ratio to the eager kernel
with the time bias, and exits non-zero if a fused variant disagrees with it beyond float32
accumulation error:

- ``eager_ts``: ``attention.block_attention`` with the time bias (the eager serving kernel);
- ``eager``: the same block without it;
- ``fused``: ``FusedAttention.history`` without it (the compiled tile);
- ``fused_ts_tile``: per tile, the bias gathered and added eagerly, then the compiled tile
  (which sees a fresh ``[n, m]`` bias each tile, a layout of its own: compiled in warm-up);
- ``fused_ts_block``: the block's whole bias gathered once a layer, then the compiled tiles.

It reaches into ``relaygr.model.fused`` for the compiled tile (``_COMPILED``, ``_run_tiles``):
a measuring script, not an API.

    PYTHONPATH=src python scripts/time_bias_ab.py --threads 2 [--queries 256 --keys 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from relaygr.engine.hostmem import tune_host_allocator
from relaygr.model.attention import (
    block_attention,
    reversed_padded,
    tile_width,
    time_buckets_sorted,
    toeplitz_reversed,
)
from relaygr.model.fused import _COMPILED, FusedAttention, _run_tiles
from relaygr.model.layers import table_lookup

HEADS, HEAD_DIM, BUCKETS, TILE_ELEMS = 4, 32, 64, 1 << 19


def variants(n: int, e: int) -> dict[str, Callable[[], torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(HEADS, n, HEAD_DIM, generator=gen)
    k, v = (torch.randn(HEADS, e, HEAD_DIM, generator=gen) for _ in range(2))
    bias = toeplitz_reversed(reversed_padded(torch.randn(e + 1, generator=gen) * 0.1, n),
                             e - n, n, e, e)
    ts = torch.cumsum(torch.randint(1, 10**5, (e,), generator=gen), 0)
    buckets = time_buckets_sorted(ts[e - n:].flip(0), ts, BUCKETS)
    table = torch.randn(BUCKETS, generator=gen) * 0.1
    segments, width = [(k, v)], tile_width(TILE_ELEMS, HEADS * n)
    fused = FusedAttention(TILE_ELEMS)
    if not fused.ready(q.device):
        raise SystemExit(f"the fused kernel is unavailable here: {fused.describe(q.device)}")
    tile = _COMPILED.require()

    def fused_ts_tile() -> torch.Tensor:
        out = torch.zeros_like(q)
        for start in range(0, e, width):
            m = min(width, e - start)
            cols = slice(start, start + m)
            out += tile(q, k, v, table_lookup(table, buckets[:, cols]).add_(bias[:, cols]),
                        start, 0, m)
        return out.flip(1)

    def fused_ts_block() -> torch.Tensor:
        out = torch.zeros_like(q)
        _run_tiles(tile, out, q, segments, table_lookup(table, buckets).add_(bias), width)
        return out.flip(1)

    return {
        "eager_ts": lambda: block_attention(q, segments, bias, 1.0, width, (table, buckets)),
        "eager": lambda: block_attention(q, segments, bias, 1.0, width),
        "fused": lambda: fused.history(q, segments, bias, None, 1.0),
        "fused_ts_tile": fused_ts_tile,
        "fused_ts_block": fused_ts_block,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    tune_host_allocator()
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        fns = variants(args.queries, args.keys)
        reference = fns["eager_ts"]()
        # float32 sums over the keys in another order: a few ulps of the largest partial sum
        tolerance = 8 * args.keys * torch.finfo(torch.float32).eps * reference.abs().max().item()
        agree = True
        for name in ("fused_ts_tile", "fused_ts_block"):
            for _ in range(3):            # compile and warm
                got = fns[name]()
            diff = (got - reference).abs().max().item()
            agree &= diff <= tolerance
            print(f"{name}: max |diff| vs eager_ts {diff:.2e} (tolerance {tolerance:.2e})")
        fns["fused"]()
        names = list(fns)
        ms: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                start = time.perf_counter()
                fns[name]()
                ms[name].append((time.perf_counter() - start) * 1e3)
    skip = min(5, args.rounds // 2)
    base = ms["eager_ts"][skip:]
    for name, xs in ms.items():
        paired = statistics.median(a / b for a, b in zip(xs[skip:], base, strict=True))
        print(f"{name:15s} median {statistics.median(xs[skip:]):7.2f} ms   "
              f"paired ratio to eager_ts {paired:.3f}")
    if not agree:
        raise SystemExit("a fused variant disagrees with the eager kernel")


if __name__ == "__main__":
    main()
