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
    ExactnessConfig,
    LimitConfig,
    MixedConfig,
    PointBudget,
    QpsSearchConfig,
    SweepConfig,
    ThroughputConfig,
    WorkloadPhaseConfig,
)
from relaygr.bench.cost_curve import LengthSearch
from relaygr.bench.instance_probe import InstanceCostProbe
from relaygr.bench.layout import Layout
from relaygr.bench.limit import LimitProbe, ModelLimitProbe
from relaygr.bench.operating import CostProbe
from relaygr.bench.profiles import DLRMV3_CPU_SCALE, PROFILES, BenchProfile, profile_named
from relaygr.bench.systems import SharedParts, mode_factories
from relaygr.bench.workload import SyntheticConfig
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
from relaygr.cli.config import as_plain
from relaygr.engine.hostmem import tune_host_allocator
from relaygr.engine.instance import InstanceConfig
from relaygr.engine.transport.processes import (
    PLACEMENTS,
    InstanceProcesses,
    threads_per_instance,
    wants_processes,
)
from relaygr.model import HSTU, HSTUConfig
from relaygr.relay.measure import fit_on_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure relay against baseline, reactive and ablations",
                       description=__doc__)
    p.add_argument("--quick", action="store_true", help="a smoke run (minutes, not hours)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="default: dlrmv3 on CUDA, cpu otherwise")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--instances", type=int, default=None,
                   help="ranking instances (default: one per GPU, 2 on CPU)")
    p.add_argument("--instance-processes", choices=PLACEMENTS, default="auto",
                   help="run each ranking instance in a process of its own (auto: on CPU; on "
                        "CUDA each instance runs on a worker thread of this process)")
    p.add_argument("--slo-ms", type=float, default=None, help="ranking P99 SLO (profile's)")
    p.add_argument("--modes", default=None,
                   help="comma-separated modes, measured in this order (default: all six; "
                        "--quick: baseline, reactive, relay)")
    p.add_argument("--retrieval-run", type=Path, default=None, metavar="RUN",
                   help="a `relaygr train-retrieval` run on MovieLens-1M serving retrieval in the "
                        "ML-1M replay phase (added to --quick): live and measured on each "
                        "request's path, simulated stage delays 0. The synthetic workloads keep "
                        "the model's item embeddings (their items name no dataset)")
    p.add_argument("--slo-share", type=float, default=ThroughputConfig.slo_share,
                   help="the fixed-length throughput search runs at the prefix length where "
                        "the P99 of the baseline's full ranking pass alone takes this share of "
                        "the SLO, measured on this machine (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    p.add_argument("--json", type=Path, default=None, help="default: OUT/bench.json")
    p.set_defaults(func=run, effective_config=effective_config)


def _instances(args: argparse.Namespace, device: torch.device) -> tuple[int, tuple[str, ...]]:
    if device.type == "cuda":
        count = args.instances or torch.cuda.device_count()
        return count, tuple(f"cuda:{i % torch.cuda.device_count()}" for i in range(count))
    return args.instances or 2, ("cpu",)


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
    num_instances, devices = _instances(args, device)
    # On CPU, one core per instance: instances compute in parallel without oversubscribing.
    threads = (threads_per_instance(num_instances) if device.type == "cpu"
               else torch.get_num_threads())
    slo_ms = args.slo_ms or profile.slo_ms
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


# The throughput searches start at the grid's highest rate at or below this share of the
# baseline's compute capacity at the operating point (ThroughputConfig.start_capacity_share):
# the baseline's SLO throughput there lies at a fifth to a third of it on this project's 2-core
# box (docs/runs/2026-11-28-quick-runs-search-from-capacity.md), so the climb starts a step or
# so below its answer.
START_CAPACITY_SHARE = 0.2
# The quick run's modes: today's production path, its best cache-only peer, and the relay.
QUICK_MODES = ("baseline", "reactive", "relay")
# The quick run's sweep and searches run at this multiple of the profile's sweep load: a P99
# pass needs a few hundred requests, which take minutes at the full run's sweep load.
QUICK_LOAD_SCALE = 4.0
# The quick run's deadline for its searching phases, in seconds from the suite's start: five
# minutes less the start-up before it (~11 s: the cost model's fit, the instance processes), the
# limit point and exactness replay after it (~40 s: 23 requests at 1 QPS, 25 paced passes, 2 x
# 60 requests at 8 QPS, each system's set-up), the report (~3 s) and a margin for a slow box.
QUICK_DEADLINE_S = 230.0
# The quick run's exactness replay: 60 requests at 8 QPS, 8 s a mode (scores do not depend on
# load; the relay's paths are reported with the comparison). Its low-load point stays at 1 QPS:
# at the limit's 2,048 tokens each request's pre-inference is ~100 ms of one core, and at 4 QPS
# that contention alone put the relay's compute 4.4 ms over the pass timed alone.
QUICK_REPLAY_QPS = 8.0


def run_plan(profile: BenchProfile, quick: bool, slo_ms: float, seed: int, device: str,
             model: HSTUConfig, slo_share: float | None = ThroughputConfig.slo_share
             ) -> BenchConfig:
    """How much is measured: the full run or the quick one (< 5 min on a 2-core CPU).

    Every point stops once its P99 verdict is decided (``relaygr.bench.decision``) and may take
    enough requests to pass. Full: verdicts at 99% confidence, 540-1,024 measured requests a
    point (a pass needs 533 with no overage), all six modes in every headline phase, the extra
    workloads (ML-1M replay and the DLRMv3 profile with and without cross-request reuse). Every
    mode's sweep starts at the third grid length (512 on the cpu profile; it walks down if that
    does not pass), the modes without a bar on length (reactive and the three ablations) sweep
    every other length; searches start at twice the profile's search start (8 QPS on cpu; the
    fixed-length one, at the operating point, at its grid's rate at or below a fifth of the
    baseline's capacity there), go no lower than half of it, and take up to 10 minutes of
    measuring per mode. Warm-up: 25 requests or 2 s of the schedule, whichever is more (a fresh
    system's caches fill first). Quick: verdicts at 90% confidence, 230-512 measured requests a
    point (a clean pass at 230 of 256 or 270 of 512, one with a single overage at 438 of 512)
    after the same warm-up, three modes, every other length from the second, sweep and searches
    from 4x the profile's sweep load (16 QPS on cpu: a passing point takes ~15 s there, a minute
    at 4 QPS; the fixed-length search from a fifth of the baseline's capacity, on the same x2
    grid), sweeps of 45 s and searches of 40 s of measuring per mode, the searches down to a
    quarter of that load and none on the mixed workload (it serves the exactness replay, 60
    requests at 8 QPS), one re-measure of a point under noise, a 20-request limit point, no
    extra workloads, and a deadline (``QUICK_DEADLINE_S``) by which the sweep and searches
    end, so that the whole run takes under five minutes: a smoke figure of the same shape. Both
    compare throughput at this machine's operating point (``relaygr.bench.operating``,
    ``slo_share``).
    """
    population = SyntheticConfig.from_dict(profile.population_params())
    extra: tuple[WorkloadPhaseConfig, ...] = ()
    mixed_search: QpsSearchConfig | None
    if quick:
        # 2 s of warm-up as in the full plan: judged after every request, a point otherwise
        # fails on a fresh system's start-up (docs/runs/2026-11-25-quick-p99-verdicts.md).
        # Up to 512 requests or the point's 16 s: room for the sequential P99 rule to pass a
        # point with a single overage (at 438 of 512), which 256 requests never can
        budget = PointBudget(measured_requests=512, min_measured_requests=230,
                             warmup_requests=8, warmup_s=2.0, max_point_s=16.0,
                             confidence=0.9, max_remeasures=1)
        load = QUICK_LOAD_SCALE * profile.sweep_qps
        # down to a quarter of the load: at the operating point the P99 of the baseline's pass
        # alone takes half the SLO, and a search that stops above its answer bounds no ratio
        search = QpsSearchConfig(start_qps=load, rel_tol=0.3, budget_s=40.0, min_qps=load / 4)
        lengths = profile.sweep_lengths[1::2]
        # 45 s of measuring a mode: two passing lengths (~17 s each at this load), a fail and
        # its re-measure; a sweep that needs more stops there with what it has decided
        sweep = SweepConfig(lengths=lengths, qps=load, start=lengths[min(1, len(lengths) - 1)],
                            budget_s=45.0)
        mixed_search = None
    else:
        budget = PointBudget(measured_requests=1024, min_measured_requests=540,
                             warmup_requests=25, warmup_s=2.0, max_point_s=25.0)
        # from twice the quick start, and never below half of it: a passing point at low QPS
        # costs minutes (540 requests at 2 QPS), and below that the answer is "none" anyway
        search = QpsSearchConfig(start_qps=2 * profile.search_start_qps, rel_tol=0.15,
                                 budget_s=600.0, min_qps=profile.search_start_qps / 2)
        lengths = profile.sweep_lengths
        sweep = SweepConfig(lengths=lengths, qps=profile.sweep_qps,
                            start=lengths[min(2, len(lengths) - 1)],
                            coarse_modes=(Mode.REACTIVE.value, *ABLATIONS))
        mixed_search = search
        extra = extra_workloads(profile, replace(search, budget_s=300.0))
    # the operating point's cost curve: from the grid's first length up to its last
    curve = LengthSearch(start_tokens=profile.sweep_lengths[0],
                         min_tokens=min(32, profile.sweep_lengths[0]),
                         max_tokens=profile.sweep_lengths[-1])
    return BenchConfig(
        slo_ms=slo_ms, seed=seed, device=device, model=model, population=population,
        budget=budget, sweep=sweep, deadline_s=QUICK_DEADLINE_S if quick else None,
        throughput=ThroughputConfig(search=search, slo_share=slo_share, lengths=curve,
                                    start_capacity_share=START_CAPACITY_SHARE),
        mixed=MixedConfig(source=profile.mixed_source, params=profile.mixed_workload_params(),
                          search=mixed_search),
        limit=LimitConfig(requests=20 if quick else 100, warmup_requests=3 if quick else 10,
                          prefix_len=profile.limit_prefix_len),
        exactness=ExactnessConfig(requests=60 if quick else 64,
                                  qps=QUICK_REPLAY_QPS if quick else 1.0),
        workloads=extra)


ABLATIONS = tuple(m.value for m in (Mode.RELAY_NO_TRIGGER, Mode.RELAY_NO_AFFINITY,
                                    Mode.RELAY_NO_EXPANDER))


def _trained_ml1m(run: Path, system: SystemConfig, model: HSTU) -> RetrievalStage:
    """``run`` over the ML-1M replay's item ids (the file's movie ids in ascending order), as
    serve serves it (beside ``model``'s item embeddings at the run's share), built once."""
    movies = read_movie_ids(ML1MConfig().path)
    stage = TrainedRetrieval.load(run, RankerCatalogue("ml-1m", movies),
                                  system.stages.retrieval_history,
                                  recency=system.stages.retrieval_recency)
    return beside_the_default(stage, system.stages, model)


def ml1m_phase(profile: BenchProfile, search: QpsSearchConfig) -> WorkloadPhaseConfig:
    """ML-1M replay (real ids and lengths): baseline, reactive and relay."""
    delays = {"retrieval_ms": profile.retrieval_ms, "preprocessing_ms": profile.preprocessing_ms}
    return WorkloadPhaseConfig(
        "ml1m", "ml1m", {"num_candidates": profile.num_candidates, "stage_delays": delays},
        ("baseline", "reactive", "relay"), search)


def extra_workloads(profile: BenchProfile, search: QpsSearchConfig
                    ) -> tuple[WorkloadPhaseConfig, ...]:
    """ML-1M replay (real ids and lengths) and DLRMv3 without / with cross-request reuse."""
    delays = {"retrieval_ms": profile.retrieval_ms, "preprocessing_ms": profile.preprocessing_ms}
    phases = [ml1m_phase(profile, search)]
    if profile.mixed_source != "dlrmv3":
        phases.append(WorkloadPhaseConfig(
            "dlrmv3", "dlrmv3", {**DLRMV3_CPU_SCALE, "num_items": profile.num_items,
                                 "stage_delays": delays},
            ("baseline", "relay-closed", "relay"), search))
    else:
        phases.append(WorkloadPhaseConfig(
            "dlrmv3", "dlrmv3", profile.mixed_workload_params(),
            ("baseline", "relay-closed", "relay"), search))
    return tuple(phases)
