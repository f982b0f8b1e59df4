"""Our HSTU passes beside Meta's open-source STU (its PyTorch path), same config, same machine.

    python scripts/peer_compare.py --peer-src ~/src/generative-recommenders \
        --peer-python ~/venvs/gr/bin/python [--lengths 1024,4096,8192] [--rounds 3]

Not part of the package and not a dependency of it: the peer is the user's own checkout of
github.com/meta-recsys/generative-recommenders (``--peer-src``, put on the peer process's
``sys.path``), run by a Python whose environment the user installed for it (``--peer-python``:
torch, fbgemm-gpu-cpu, torchrec, triton, as its README says). Nothing of the peer is copied here.

Both sides run the same shape: 4 layers, dim 128, 4 heads of 32, float32, ``--threads`` torch
threads, 256 candidates, one user, each pass timed alone (median of ``--repeats`` calls after a
warm-up). The passes, ours / the peer's:

* prefill: ``HSTU.prefill`` of the history / ``STUStack.forward`` over it, caching its K/V;
* full: ``HSTU.rank`` recomputing the history / ``STUStack.forward`` over history + candidates
  with ``num_targets`` = candidates (target-aware: a candidate sees the history and itself);
* cached: ``HSTU.rank`` from the cached prefix / ``STUStack.cached_forward`` of the candidates.

The peer's STU has no relative position or time bias, so ours runs without timestamps. Each round
starts one process per side, in alternating order, so both sides see the same share of whatever
else the machine runs; the ratios (peer ms / our ms) are per round, printed as the median and the
range over rounds. A worker prints one JSON line: ``{"side", "attention", "points": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

LAYERS, DIM, HEADS, HEAD_DIM = 4, 128, 4, 32
NUM_ITEMS = 100_000
PASSES = ("prefill", "full", "cached")
STU_MODULE = Path("generative_recommenders/modules/stu.py")


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _ours(lengths: list[int], candidates: int, repeats: int, attention: str) -> dict:
    from relaygr.engine.hostmem import tune_host_allocator
    from relaygr.model import HSTU, config_for_size

    tune_host_allocator()
    cfg = config_for_size("small", NUM_ITEMS, max_seq_len=max(lengths), attention=attention)
    assert (cfg.num_layers, cfg.dim, cfg.num_heads, cfg.head_dim) == (LAYERS, DIM, HEADS,
                                                                       HEAD_DIM)
    torch.manual_seed(0)
    model = HSTU(cfg).eval()
    described = model.warm_up()
    gen = torch.Generator().manual_seed(1)
    points = []
    for n in lengths:
        items = torch.randint(1, NUM_ITEMS + 1, (n,), generator=gen)
        cands = torch.randint(1, NUM_ITEMS + 1, (candidates,), generator=gen)
        kv = model.prefill(items)
        prefill = partial(model.prefill, items)
        full = partial(model.rank, cands, prefix_items=items)
        cached = partial(model.rank, cands, prefix=kv)
        points.append({"tokens": n, "prefill": _median_ms(prefill, repeats),
                       "full": _median_ms(full, repeats), "cached": _median_ms(cached, repeats)})
    return {"side": "ours", "attention": described, "points": points}


def _peer(peer_src: Path, lengths: list[int], candidates: int, repeats: int) -> dict:
    sys.path.insert(0, str(peer_src))
    import generative_recommenders.modules.stu as stu_module
    from generative_recommenders.common import HammerKernel
    from generative_recommenders.modules.stu import STULayer, STULayerConfig, STUStack

    # The PyTorch path of its cached attention returns a non-contiguous [C, H, dh] tensor, which
    # cached_forward then .view()s (an error); made contiguous here (one C x d copy a layer).
    delta_attention = stu_module.delta_hstu_mha

    def contiguous_delta_attention(**kwargs: object) -> torch.Tensor:
        return delta_attention(**kwargs).contiguous()

    stu_module.delta_hstu_mha = contiguous_delta_attention

    torch.manual_seed(0)
    config = STULayerConfig(embedding_dim=DIM, num_heads=HEADS, hidden_dim=HEAD_DIM,
                            attention_dim=HEAD_DIM, output_dropout_ratio=0.0, causal=True,
                            target_aware=True, use_group_norm=False)
    stack = STUStack([STULayer(config, is_inference=True) for _ in range(LAYERS)],
                     is_inference=True).eval()
    stack.set_hammer_kernel(HammerKernel.PYTORCH)
    gen = torch.Generator().manual_seed(1)
    points = []
    with torch.inference_mode():
        for n in lengths:
            history = torch.randn(n, DIM, generator=gen)
            both = torch.randn(n + candidates, DIM, generator=gen)
            delta = torch.randn(candidates, DIM, generator=gen)

            def prefill(x: torch.Tensor = history, n: int = n) -> torch.Tensor:
                return stack(x=x, x_lengths=torch.tensor([n]), x_offsets=torch.tensor([0, n]),
                             max_seq_len=n, num_targets=torch.tensor([0]),
                             max_kv_caching_len=n, kv_caching_lengths=torch.tensor([n]))

            def full(x: torch.Tensor = both, t: int = n + candidates) -> torch.Tensor:
                return stack(x=x, x_lengths=torch.tensor([t]), x_offsets=torch.tensor([0, t]),
                             max_seq_len=t, num_targets=torch.tensor([candidates]))

            def cached(x: torch.Tensor = delta) -> torch.Tensor:
                return stack.cached_forward(delta_x=x, num_targets=torch.tensor([candidates]))

            point = {"tokens": n, "prefill": _median_ms(prefill, repeats),
                     "full": _median_ms(full, repeats)}
            prefill()   # the cache cached_forward reads: this history's K/V
            point["cached"] = _median_ms(cached, repeats)
            points.append(point)
    return {"side": "peer", "attention": "STU PyTorch path", "points": points}


def _check_peer(peer_src: Path, peer_python: Path) -> str | None:
    if not (peer_src / STU_MODULE).is_file():
        return (f"--peer-src {peer_src} has no {STU_MODULE}: give the path of a checkout of "
                "github.com/meta-recsys/generative-recommenders")
    if not peer_python.is_file():
        return (f"--peer-python {peer_python} is not a file: give the python of an environment "
                "with the peer's dependencies (torch, fbgemm-gpu-cpu, torchrec, triton)")
    return None


def _run_worker(python: str, side: str, args: argparse.Namespace) -> dict:
    command = [python, __file__, "--worker", side, "--peer-src", str(args.peer_src),
               "--lengths", ",".join(map(str, args.lengths)), "--candidates",
               str(args.candidates), "--threads", str(args.threads), "--repeats",
               str(args.repeats), "--attention", args.attention]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"the {side} process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def _compare(args: argparse.Namespace) -> int:
    problem = _check_peer(args.peer_src, args.peer_python)
    if problem:
        print(f"peer_compare: {problem}", file=sys.stderr)
        return 2
    ratios: dict[tuple[int, str], list[float]] = {}
    runs: list[dict] = []
    for r in range(args.rounds):
        sides = [("ours", sys.executable), ("peer", str(args.peer_python))]
        results = {}
        for side, python in (sides if r % 2 == 0 else sides[::-1]):
            results[side] = _run_worker(python, side, args)
            print(f"round {r + 1} {side}: {results[side]['points']}", flush=True)
        runs.append(results)
        for ours, peer in zip(results["ours"]["points"], results["peer"]["points"],
                              strict=True):
            for name in PASSES:
                ratios.setdefault((ours["tokens"], name), []).append(peer[name] / ours[name])
    print(f"\npeer ms / our ms ({args.rounds} rounds, alternating; ours: "
          f"{runs[-1]['ours']['attention']}; {args.threads} threads, {args.candidates} "
          "candidates)")
    print(f"{'tokens':>7} " + " ".join(f"{name:>24}" for name in PASSES))
    for n in args.lengths:
        cells = []
        for name in PASSES:
            xs = ratios[(n, name)]
            cells.append(f"{statistics.median(xs):7.1f}x [{min(xs):6.1f}, {max(xs):6.1f}]")
        print(f"{n:>7} " + " ".join(f"{cell:>24}" for cell in cells))
    if args.json:
        args.json.write_text(json.dumps({"rounds": runs, "threads": args.threads,
                                         "candidates": args.candidates}, indent=2))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer-src", type=Path, required=True,
                   help="your checkout of meta-recsys/generative-recommenders")
    p.add_argument("--peer-python", type=Path, help="python of the peer's environment")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1024, 4096, 8192])
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per pass (median)")
    p.add_argument("--rounds", type=int, default=3, help="process pairs, order alternating")
    p.add_argument("--attention", choices=["eager", "fused"], default="fused",
                   help="our attention kernel")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", choices=["ours", "peer"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is None:
        if args.peer_python is None:
            p.error("--peer-python is required")
        return _compare(args)
    torch.set_num_threads(args.threads)
    if args.worker == "ours":
        result = _ours(args.lengths, args.candidates, args.repeats, args.attention)
    else:
        result = _peer(args.peer_src, args.lengths, args.candidates, args.repeats)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
