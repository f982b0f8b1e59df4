"""``relaygr bench``: every serving mode side by side on one model, machine and workload.

Measures, per mode: the longest prefix whose ranking P99 meets the SLO at a fixed load, the
highest SLO-compliant Poisson QPS at a fixed long prefix and on the mixed workload, the relay's
overhead over the isolated cached ranking pass, and score exactness against the baseline.
Writes bench.json and PNG plots into --out and prints the table (see docs/benchmark.md).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console

from relaygr.bench.benchmark import run_benchmark
from relaygr.bench.config import BenchConfig, MixedConfig, SweepConfig
from relaygr.bench.limit import ModelLimitProbe
from relaygr.bench.profiles import PROFILES, profile_named
from relaygr.bench.systems import SharedParts, mode_factories
from relaygr.bench.workload import SyntheticConfig
from relaygr.cascade.config import SystemConfig
from relaygr.cascade.modes import Mode
from relaygr.cascade.retrieval import Retriever
from relaygr.model import HSTU, HSTUConfig
from relaygr.relay.measure import fit_on_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure relay against baseline, reactive and ablations",
                       description=__doc__)
    p.add_argument("--quick", action="store_true", help="a smoke run (minutes, not an hour)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="default: dlrmv3 on CUDA, cpu otherwise")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--instances", type=int, default=None,
                   help="ranking instances (default: one per GPU, 2 on CPU)")
    p.add_argument("--slo-ms", type=float, default=None, help="ranking P99 SLO (profile's)")
    p.add_argument("--modes", default=",".join(m.value for m in Mode),
                   help="comma-separated modes, measured in this order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    p.add_argument("--json", type=Path, default=None, help="default: OUT/bench.json")
    p.set_defaults(func=run)


def _instances(args: argparse.Namespace, device: torch.device) -> tuple[int, tuple[str, ...]]:
    if device.type == "cuda":
        count = args.instances or torch.cuda.device_count()
        return count, tuple(f"cuda:{i % torch.cuda.device_count()}" for i in range(count))
    return args.instances or 2, ("cpu",)


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 120))
    device = torch.device(args.device)
    profile = profile_named(args.profile or ("dlrmv3" if device.type == "cuda" else "cpu"))
    modes = [Mode.parse(m.strip()).value for m in args.modes.split(",") if m.strip()]
    num_instances, devices = _instances(args, device)
    if device.type == "cpu":
        # One core per instance: instances compute in parallel without oversubscribing.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_instances))
    slo_ms = args.slo_ms or profile.slo_ms
    torch.manual_seed(args.seed)
    model_cfg = HSTUConfig(num_items=profile.num_items, max_seq_len=profile.max_seq_len,
                           **profile.model_size)
    model = HSTU(model_cfg).to(device=device, dtype=getattr(torch, profile.dtype)).eval()
    console.print(f"[bold]relaygr bench[/] profile {profile.name}: {model_cfg.num_layers} "
                  f"layers, dim {model_cfg.dim}, {model_cfg.num_heads} heads, {profile.dtype} "
                  f"on {device} "
                  f"({torch.get_num_threads()} threads), {num_instances} instances, "
                  f"SLO {slo_ms:g} ms, modes {', '.join(modes)}")
    console.print("fitting the latency cost model on this machine ...")
    parts = SharedParts(model, fit_on_model(model, device), Retriever.from_model(model))
    system = SystemConfig(num_instances=num_instances, devices=devices, slo_ms=slo_ms,
                          num_candidates=profile.num_candidates,
                          retrieval_k=4 * profile.num_candidates,
                          device_budget_bytes=profile.device_budget_bytes,
                          host_budget_bytes=profile.host_budget_bytes)
    population = SyntheticConfig.from_dict(profile.population_params())
    make = BenchConfig.quick if args.quick else BenchConfig.full
    config = make(slo_ms=slo_ms, seed=args.seed, device=str(device), model=model_cfg,
                  population=population)
    assert config.sweep is not None and config.mixed is not None
    lengths = profile.sweep_lengths[1:] if args.quick else profile.sweep_lengths
    config = replace(config, sweep=SweepConfig(lengths=lengths, qps=profile.sweep_qps),
                     mixed=MixedConfig(source=profile.mixed_source,
                                       params=profile.mixed_workload_params(),
                                       search=config.mixed.search))
    factories = mode_factories(modes, system, parts)
    run_benchmark(factories, config, args.out, ModelLimitProbe(model), json_path=args.json,
                  console=console)
    return 0
