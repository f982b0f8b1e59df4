"""The simulated benchmark the bench tests share: one FIFO server per mode whose service time is
a + b x prefix tokens (``tests.bench.fakes.SimulatedServer``), a synthetic population, and a
plan small enough to run in seconds with every answer known offline."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from relaygr.bench import noise as noise_module
from relaygr.bench.config import (
    BenchConfig,
    ExactnessConfig,
    LimitConfig,
    MixedConfig,
    PointBudget,
    QpsSearchConfig,
    SweepConfig,
    ThroughputConfig,
)
from relaygr.bench.hardware import CpuTimes
from relaygr.bench.layout import Layout
from relaygr.bench.protocol import SystemContext
from relaygr.bench.workload import StageDelays, SyntheticConfig
from relaygr.model import HSTUConfig
from tests.bench.fakes import SimulatedServer, service_time

SLO_MS = 1.0
SERVICE = {"baseline": service_time(20e-6, 0.4e-6),    # full recompute: cost grows with length
           "reactive": service_time(20e-6, 0.1e-6),
           "relay": service_time(20e-6, 0.02e-6)}      # cached: little per prefix token
PATHS = {"baseline": "full", "reactive": "host_hit", "relay": "device_hit"}
POPULATION = SyntheticConfig(num_users=3000, num_items=500, num_candidates=4,
                             recent_events_mean=2.0, stage_delays=StageDelays(0.0, 0.0))
MIXED = {"num_users": 3000, "num_items": 500, "num_candidates": 4, "recent_events_mean": 2.0,
         "prefix_len": {"kind": "lognormal", "median": 300.0, "sigma": 0.8,
                        "max_tokens": 2048},
         "stage_delays": {"retrieval_ms": 0.0, "preprocessing_ms": 0.0}}
SEARCH = QpsSearchConfig(start_qps=1000.0, rel_tol=0.1, min_qps=50.0, max_qps=50_000.0)
CONFIG = BenchConfig(
    slo_ms=SLO_MS, seed=7, population=POPULATION,
    # every point runs to its end (its verdict is then a function of the schedule alone, see
    # ``oracle``); at 90% and 256 requests a pass needs 230 without an overage
    budget=PointBudget(measured_requests=256, min_measured_requests=256, warmup_requests=10,
                       max_point_s=1.0, max_in_flight=100_000, drain_timeout_s=5.0,
                       stop_when_decided=False, confidence=0.9,
                       remeasure_slowdown=math.inf),
    sweep=SweepConfig(lengths=(128, 256, 512, 1024, 2048), qps=2000.0),
    # the operating point (with a cost probe): the simulated baseline's 0.02 + 0.0004 x tokens
    # ms takes a quarter of the 1 ms SLO at 575 tokens (576, a multiple of 16); a half, at
    # 1,200, would leave it a few hundred QPS and the real-time points would take seconds each
    throughput=ThroughputConfig(search=SEARCH, slo_share=0.25),
    mixed=MixedConfig(source="synthetic", params=MIXED, search=SEARCH),
    limit=LimitConfig(mode="relay", qps=200.0, requests=30, warmup_requests=3),
    exactness=ExactnessConfig(requests=12, qps=500.0),
    model=HSTUConfig(num_items=500, dim=32, num_layers=2, num_heads=2),
    measure_matmul_peak=False)


class CurveProbe:
    """A machine's cost curves, simulated: the full pass costs ``full_ms(prefix tokens)`` (no
    clock involved), a call over B users ``batch_cost(B)`` times that (B: no gain from
    batching); the cached pass costs ``cached_ms``. In a run of single-user passes
    (``full_rank_samples_ms``) the slowest ``tail_share`` of them cost ``tail_ratio`` x the
    pass (1: no tail). Records every call."""

    def __init__(self, full_ms: Callable[[int], float], cached_ms: float = 0.05,
                 batch_cost: Callable[[int], float] = float, tail_ratio: float = 1.0,
                 tail_share: float = 0.05) -> None:
        self.full_ms, self.cached_ms, self.batch_cost = full_ms, cached_ms, batch_cost
        self.tail_ratio, self.tail_share = tail_ratio, tail_share
        self.calls: list[tuple[int, int, int, int]] = []
        self.full_calls: list[tuple[int, int, int]] = []
        self.sample_runs: list[int] = []

    def full_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                             passes: int) -> list[float]:
        self.sample_runs.append(passes)
        median = self.full_rank_ms(prefix_tokens, suffix_tokens, candidates)
        slow = round(self.tail_share * passes)
        return [median] * (passes - slow) + [self.tail_ratio * median] * slow

    def cached_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                               passes: int) -> list[float]:
        self.calls.append((prefix_tokens, suffix_tokens, candidates, passes))
        return [self.cached_ms] * passes

    def full_rank_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                     batch: int = 1) -> float:
        self.full_calls.append((prefix_tokens, suffix_tokens, candidates))
        return self.full_ms(prefix_tokens) * self.batch_cost(batch)


class LayoutCurveProbe(CurveProbe):
    """``CurveProbe`` on ``layout`` (a ``LayoutProbe``): on K instances of T threads the pass
    costs ``full_ms`` x ``contention(K)`` / ``speedup(T)`` (``contention(1)`` and
    ``speedup(1)`` are 1). Records every layout timed."""

    def __init__(self, full_ms: Callable[[int], float], layout: Layout,
                 contention: Callable[[int], float], speedup: Callable[[int], float],
                 batch_cost: Callable[[int], float] = float) -> None:
        super().__init__(full_ms, batch_cost=batch_cost)
        self.layout, self.contention, self.speedup = layout, contention, speedup
        self.layout_calls: list[tuple[Layout, int, int]] = []

    def layout_rank_ms(self, layout: Layout, prefix_tokens: int, suffix_tokens: int,
                       candidates: int, batch: int = 1) -> float:
        self.layout_calls.append((layout, prefix_tokens, batch))
        return (self.full_ms(prefix_tokens) * self.batch_cost(batch)
                * self.contention(layout.instances) / self.speedup(layout.threads))

    def full_rank_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                     batch: int = 1) -> float:
        self.full_calls.append((prefix_tokens, suffix_tokens, candidates))
        return self.layout_rank_ms(self.layout, prefix_tokens, suffix_tokens, candidates,
                                   batch)


def simulated_baseline_ms(prefix_tokens: int) -> float:
    """The simulated baseline's service time in ms: the curve its machine's probe measures."""
    return SERVICE["baseline"](prefix_tokens) * 1e3


def factory(mode: str) -> Callable[[SystemContext], SimulatedServer]:
    noise = 1e-7 if mode == "relay" else 0.0
    return lambda ctx: SimulatedServer(ctx, SERVICE[mode], PATHS[mode], score_noise=noise,
                                       bytes_per_token=8 if mode != "baseline" else 0)


def fake_steal(monkeypatch: pytest.MonkeyPatch, share: float) -> dict[str, float]:
    """Make the suite read CPU times of which ``steal["share"]`` was stolen (mutable)."""
    ticks = iter(range(0, 10**6, 1000))
    steal = {"share": share}

    def fake_cpu_times() -> CpuTimes:
        total = next(ticks)
        return CpuTimes(steal=int(total * steal["share"]), total=total)

    monkeypatch.setattr(noise_module, "cpu_times", fake_cpu_times)
    return steal
