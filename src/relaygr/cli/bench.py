"""``relaygr bench``: every serving mode side by side on one model, machine and workload.

Measures, per mode: the longest prefix whose ranking P99 meets the SLO at a fixed load, the
highest SLO-compliant Poisson QPS at a fixed long prefix and on the mixed workload, the relay's
overhead over the isolated cached ranking pass, and score exactness against the baseline.
Writes bench.json and PNG plots into --out and prints the table (see docs/benchmark.md); while
it runs, --out/points.jsonl records each point and phase as it finishes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from relaygr.bench.benchmark import run_benchmark
from relaygr.bench.config import (
    BenchConfig,
    QpsSearchConfig,
    ThroughputConfig,
)
from relaygr.bench.instance_probe import InstanceCostProbe
from relaygr.bench.layout import Layout
from relaygr.bench.limit import LimitProbe, ModelLimitProbe
from relaygr.bench.operating import CostProbe
from relaygr.bench.plans import QUICK_MODES, ml1m_phase, run_plan
from relaygr.bench.profiles import PROFILES, BenchProfile, profile_named
from relaygr.bench.systems import SharedParts, mode_factories
from relaygr.bench.workload.ml1m import ML1MConfig, read_movie_ids
from relaygr.cascade.config import StagesConfig, SystemConfig
from relaygr.cascade.instances import build_instance
from relaygr.cascade.modes import Mode
from relaygr.cascade.proposals import EmbeddingRetrieval, RetrievalStage
from relaygr.cascade.trained_retrieval import (
    RankerCatalogue,
    TrainedRetrieval,
    beside_the_default,
)
from relaygr.cli.config import (
    as_plain,
    check_output_file,
    device_name,
    non_negative_int,
    positive_float,
    positive_int,
)
from relaygr.engine.hostmem import tune_host_allocator
from relaygr.engine.instance import InstanceConfig
from relaygr.engine.transport.processes import (
    PLACEMENTS,
    InstanceProcesses,
    threads_per_instance,
    wants_processes,
)
from relaygr.errors import ConfigError
from relaygr.model import HSTU, HSTUConfig
from relaygr.relay.measure import fit_on_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure relay against baseline, reactive and ablations",
                       description=__doc__)
    p.add_argument("--quick", action="store_true", help="a smoke run (minutes, not hours)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="default: dlrmv3 on CUDA, cpu otherwise")
    p.add_argument("--device", type=device_name,
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--instances", type=positive_int, default=None,
                   help="ranking instances (default: one per GPU, 2 on CPU)")
    p.add_argument("--instance-processes", choices=PLACEMENTS, default="auto",
                   help="run each ranking instance in a process of its own (auto: on CPU; on "
                        "CUDA each instance runs on a worker thread of this process)")
    p.add_argument("--slo-ms", type=positive_float, default=None,
                   help="ranking P99 SLO (profile's)")
    p.add_argument("--modes", default=None,
                   help="comma-separated modes, measured in this order (default: all six; "
                        "--quick: baseline, relay, reactive)")
    p.add_argument("--retrieval-run", type=Path, default=None, metavar="RUN",
                   help="a `relaygr train-retrieval` run on MovieLens-1M serving retrieval in the "
                        "ML-1M replay phase (added to --quick): live and measured on each "
                        "request's path, simulated stage delays 0. The synthetic workloads keep "
                        "the model's item embeddings (their items name no dataset)")
    p.add_argument("--slo-share", type=float, default=ThroughputConfig.slo_share,
                   help="the fixed-length throughput search runs at the prefix length where "
                        "the P99 of the baseline's full ranking pass alone takes this share of "
                        "the SLO, measured on this machine (default %(default)s)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    p.add_argument("--json", type=Path, default=None, help="default: OUT/bench.json")
    p.set_defaults(func=run, effective_config=effective_config)


def _instances(args: argparse.Namespace, device: torch.device) -> tuple[int, tuple[str, ...]]:
    if device.type == "cuda":
        count = torch.cuda.device_count() if args.instances is None else args.instances
        return count, tuple(f"cuda:{i % torch.cuda.device_count()}" for i in range(count))
    return (2 if args.instances is None else args.instances), ("cpu",)


@dataclass(frozen=True)
class BenchSetup:
    """What ``relaygr bench`` will measure, decided from its flags before any model exists
    (``relaygr config show bench ...`` prints it)."""

    profile: BenchProfile
    modes: list[str]
    device: torch.device
    threads: int                # torch threads per instance
    in_processes: bool
    model: HSTUConfig
    system: SystemConfig
    plan: BenchConfig


def setup_from_args(args: argparse.Namespace) -> BenchSetup:
    device = torch.device(args.device)
    profile = profile_named(args.profile or ("dlrmv3" if device.type == "cuda" else "cpu"))
    default_modes = QUICK_MODES if args.quick else tuple(m.value for m in Mode)
    names = args.modes.split(",") if args.modes else default_modes
    modes = [Mode.parse(m.strip()).value for m in names if m.strip()]
    if not modes:
        raise ConfigError(f"--modes {args.modes!r} names no mode")
    num_instances, devices = _instances(args, device)
    # On CPU, one core per instance: instances compute in parallel without oversubscribing.
    threads = (threads_per_instance(num_instances) if device.type == "cpu"
               else torch.get_num_threads())
    slo_ms = profile.slo_ms if args.slo_ms is None else args.slo_ms
    in_processes = wants_processes(args.instance_processes, str(device))
    size = profile.model_size
    model_cfg = HSTUConfig(num_items=profile.num_items, max_seq_len=profile.max_seq_len,
                           dim=size["dim"], num_layers=size["num_layers"],
                           num_heads=size["num_heads"])
    system = SystemConfig(num_instances=num_instances, devices=devices, slo_ms=slo_ms,
                          stages=StagesConfig(num_candidates=profile.num_candidates,
                                              retrieval_k=4 * profile.num_candidates),
                          instance=InstanceConfig(
                              device_budget_bytes=profile.device_budget_bytes,
                              host_budget_bytes=profile.host_budget_bytes))
    placement = "processes" if in_processes else "threads"
    plan = run_plan(profile, args.quick, slo_ms, args.seed, str(device), model_cfg,
                    args.slo_share)
    plan = replace(plan, instance_placement=placement, serving={
        "instances": num_instances, "threads_per_instance": threads,
        "batch_max_requests": system.instance.batch.max_requests, "placement": placement})
    if args.retrieval_run is not None and not any(p.source == "ml1m" for p in plan.workloads):
        # the plan's throughput search (the quick plan searches no mixed workload)
        search = plan.throughput.search if plan.throughput else QpsSearchConfig()
        plan = replace(plan, workloads=(*plan.workloads, ml1m_phase(profile, search)))
    return BenchSetup(profile, modes, device, threads, in_processes, model_cfg, system, plan)


def effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """``relaygr config show bench ...``: the profile, modes, system and plan it would run."""
    setup = setup_from_args(args)
    return as_plain({"profile": setup.profile, "modes": setup.modes, "device": setup.device,
                     "model": setup.model, "system": setup.system, "plan": setup.plan})


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 120))
    setup = setup_from_args(args)
    check_output_file(args.json)
    device, model_cfg, system, config = setup.device, setup.model, setup.system, setup.plan
    tune_host_allocator()  # before the first model call: see relaygr.engine.hostmem
    if device.type == "cpu":
        torch.set_num_threads(setup.threads)
    torch.manual_seed(args.seed)
    model = HSTU(model_cfg).to(device=device, dtype=getattr(torch, setup.profile.dtype)).eval()
    console.print(f"[bold]relaygr bench[/] profile {setup.profile.name}: {model_cfg.num_layers} "
                  f"layers, dim {model_cfg.dim}, {model_cfg.num_heads} heads, "
                  f"{setup.profile.dtype} on {device} "
                  f"({torch.get_num_threads()} threads), {system.num_instances} instances "
                  f"({'a process' if setup.in_processes else 'a worker thread'} each), "
                  f"SLO {system.slo_ms:g} ms, modes {', '.join(setup.modes)}")
    console.print("fitting the latency cost model on this machine ...")
    cost_model = fit_on_model(model, device)
    processes = None
    if setup.in_processes:
        processes = InstanceProcesses.for_model(model, cost_model, system.num_instances,
                                                torch_threads=torch.get_num_threads(),
                                                build=build_instance)
    parts = SharedParts(model, cost_model,
                        EmbeddingRetrieval.of(model, system.stages.retrieval_history,
                                              recency=system.stages.retrieval_recency), processes)
    if args.retrieval_run is not None:
        parts = replace(parts, measured={"ml1m": _trained_ml1m(args.retrieval_run, system,
                                                                model)})
    factories = mode_factories(setup.modes, system, parts)
    closed = mode_factories(["relay"], system.with_(instance={"cross_request_reuse": False}), parts)
    probe = ModelLimitProbe(model)   # on one instance's threads: this process's
    # Where instances are processes, both the baseline's cost curve and the limit's cached
    # pass are timed in processes set up as the instances (relaygr.bench.instance_probe): the
    # curve with every instance computing at once, the cached pass in one computing alone, as
    # the relay's low-load requests do; else in this process, where the instances compute.
    cost_probe: CostProbe = probe
    limit_probe: LimitProbe = probe
    if setup.in_processes:
        cost_probe = limit_probe = InstanceCostProbe(model, Layout(system.num_instances,
                                                                   setup.threads))
    try:
        run_benchmark(factories, config, args.out, limit_probe, json_path=args.json,
                      console=console, extra_systems={"relay-closed": closed["relay"]},
                      cost_probe=cost_probe)
    finally:
        if isinstance(cost_probe, InstanceCostProbe):
            cost_probe.close()
        parts.close()
        if processes is not None:
            processes.close()
    return 0


def _trained_ml1m(run: Path, system: SystemConfig, model: HSTU) -> RetrievalStage:
    """``run`` over the ML-1M replay's item ids (the file's movie ids in ascending order), as
    serve serves it (beside ``model``'s item embeddings and the run's item-to-item channel at
    ``StagesConfig.retrieval_shares``), built once."""
    movies = read_movie_ids(ML1MConfig().path)
    stage = TrainedRetrieval.load(run, RankerCatalogue("ml-1m", movies),
                                  system.stages.retrieval_history,
                                  recency=system.stages.retrieval_recency)
    return beside_the_default(stage, system.stages, model)
