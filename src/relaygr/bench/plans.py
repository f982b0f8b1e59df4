"""The benchmark's two plans: how much ``relaygr bench`` measures, full or ``--quick``.

``run_plan`` builds the ``BenchConfig`` of either from a profile (``bench.profiles``): the
points' budgets and confidence, the sweep's grid and load, the searches' start and reach, the
operating point's cost curve, the limit point, the exactness replay, the extra workloads and the
quick run's deadline. The reasons for each figure sit beside it.
"""

from __future__ import annotations

from dataclasses import replace

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
from relaygr.bench.profiles import DLRMV3_CPU_SCALE, BenchProfile
from relaygr.bench.workload import SyntheticConfig
from relaygr.cascade.modes import Mode
from relaygr.model import HSTUConfig

# The throughput searches start at the grid's highest rate at or below this share of the
# baseline's compute capacity at the operating point (ThroughputConfig.start_capacity_share):
# the baseline's SLO throughput there lies at a fifth to a third of it on this project's 2-core
# box (docs/runs/2026-11-28-quick-runs-search-from-capacity.md), so the climb starts a step or
# so below its answer.
START_CAPACITY_SHARE = 0.2
# The quick run's modes: today's production path, the relay, and the relay's best cache-only
# peer, in the order each phase's first round measures them: where the run's deadline leaves
# room for two points only, they are the two the headline ratios are of.
QUICK_MODES = ("baseline", "relay", "reactive")
# The modes whose bar is on length (relay >= 2x the baseline), the only ones the quick run
# sweeps: reactive's sweep decides no target, and its points (~20 s each, undecided ones
# included) came out of the deadline the throughput phase, where its bar is, needs.
LENGTH_BAR_MODES = ("baseline", "relay")
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
# How narrow the sweeps of the modes with a bar on length make their brackets past the grid
# (SweepConfig.rel_tol). Quick: its grid's 2x bracket once halved (x1.41), once more where the
# budget lets (x1.19); then a 2x bar on the relay/baseline ratio can be decided, which two 2x
# brackets never can (their ratio lies within a factor of 4). Full: its grid's x1.33-1.5 steps
# down to within 10 %, a couple of points a mode.
QUICK_LENGTH_TOL = 0.25
FULL_LENGTH_TOL = 0.1


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
    every other length, the others narrow their brackets to ``FULL_LENGTH_TOL``; searches start
    at twice the profile's search start (8 QPS on cpu; the fixed-length one, at the operating
    point, at its grid's rate at or below a fifth of the baseline's capacity there), go no lower
    than half of it, and take up to 10 minutes of measuring per mode. Warm-up: 25 requests or 2
    s of the schedule, whichever is more (a fresh system's caches fill first). Quick: verdicts
    at 90% confidence, 230-512 measured requests a point (a clean pass at 230 of 256 or 270 of
    512, one with a single overage at 438 of 512) after the same warm-up, three modes, the sweep
    of baseline and relay only (``LENGTH_BAR_MODES``) over every other length from the second,
    their brackets then narrowed to ``QUICK_LENGTH_TOL`` while the sweep's budget lasts, sweep
    and searches from 4x the profile's sweep load (16 QPS on cpu: a passing point takes ~15 s
    there, a minute at 4 QPS; the fixed-length search from a fifth of the baseline's capacity,
    on the same x2 grid), sweeps of 45 s and searches of 40 s of measuring per mode, the
    searches down to a quarter of that load and none on the mixed workload (it serves the
    exactness replay, 60 requests at 8 QPS), one re-measure of a point under noise, a 20-request
    limit point, no extra workloads, and a deadline (``QUICK_DEADLINE_S``) by which the sweep
    and searches end, so that the whole run takes under five minutes: a smoke figure of the same
    shape. Both compare throughput at this machine's operating point
    (``relaygr.bench.operating``, ``slo_share``).
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
                            budget_s=45.0, rel_tol=QUICK_LENGTH_TOL, modes=LENGTH_BAR_MODES)
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
                            coarse_modes=(Mode.REACTIVE.value, *ABLATIONS),
                            rel_tol=FULL_LENGTH_TOL)
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
