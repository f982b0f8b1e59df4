"""Configuration of a benchmark run: frozen dataclasses, validated, unknown keys rejected.

Requests per point (``PointBudget``): a point sends w warm-up + up to n measured requests with
w = max(``warmup_requests``, QPS x ``warmup_s``) and
n = clamp(QPS x ``max_point_s``, ``min_measured_requests``, ``measured_requests``): the most a
point may take. It stops as soon as its P99 verdict is decided (``relaygr.bench.decision``, at
``confidence``), so n matters for points near the SLO: a pass needs at least 459 requests at
99% confidence in a single test (230 at 90%), and looked at after every request (the sequential
rule the meter uses) 533 at 99% for points of up to 1,024 (596 up to 2,048), 230 at 90% for up to
256 (270 up to 512); a point too short for that can fail or stay undecided, never pass.
Points that clearly fail stop after a few overages, which keeps searches short.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from relaygr.bench.cost_curve import LengthSearch
from relaygr.bench.decision import P99Rule
from relaygr.bench.search import LengthSweep
from relaygr.bench.workload import SyntheticConfig
from relaygr.errors import ConfigError
from relaygr.model import HSTUConfig
from relaygr.settings import load


@dataclass(frozen=True)
class PointBudget:
    """How many requests one point sends, and how it is driven (module docstring)."""

    measured_requests: int = 2000
    min_measured_requests: int = 1000
    warmup_requests: int = 200
    # Warm-up also lasts at least this long: every point starts a fresh system (empty caches,
    # new worker threads), and at high QPS a fixed request count is over before the caches
    # hold the returning users' prefixes, so the measurement would start inside the start-up.
    warmup_s: float = 0.0
    max_point_s: float = 60.0
    max_in_flight: int = 256
    drain_timeout_s: float = 10.0
    stop_when_decided: bool = True
    # The confidence of each P99 verdict: MLPerf's early-stopping confidence.
    confidence: float = 0.99
    # A point that does not pass while more than ``remeasure_steal`` of the CPU time was stolen
    # by the hypervisor (a noisy neighbour on a shared VM), or while a fixed calibration
    # workload ran more than ``remeasure_slowdown`` x slower than its best time in the run, is
    # measured again, up to ``max_remeasures`` times; every attempt is kept in the report.
    # Noise only slows a system down, so a point that passes despite it stands.
    remeasure_steal: float = 0.03
    remeasure_slowdown: float = 1.5
    max_remeasures: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.min_measured_requests <= self.measured_requests:
            raise ConfigError("need 1 <= min_measured_requests <= measured_requests")
        if self.warmup_requests < 0 or self.max_point_s <= 0 or self.max_in_flight < 1 \
                or self.warmup_s < 0:
            raise ConfigError("warmup_requests >= 0, warmup_s >= 0, max_point_s > 0, "
                              "max_in_flight >= 1")
        if self.max_remeasures < 0 or not 0 <= self.remeasure_steal <= 1 \
                or self.remeasure_slowdown < 1:
            raise ConfigError("max_remeasures >= 0, remeasure_steal in [0, 1] and "
                              "remeasure_slowdown >= 1")
        if not 0.5 < self.confidence < 1:
            raise ConfigError(f"confidence must be in (0.5, 1), got {self.confidence}")

    def warmup_at(self, qps: float) -> int:
        return max(self.warmup_requests, math.ceil(qps * self.warmup_s))

    def measured_at(self, qps: float) -> int:
        """Requests measured at ``qps``: what ``max_point_s`` allows, clamped to the budget's
        range, and never a size just past a power of two whose sequential P99 rule could not
        pass within it (257-269 at 90 %: the rule of 512 needs 270): the power below instead."""
        by_time = math.floor(qps * self.max_point_s)
        n = max(self.min_measured_requests, min(self.measured_requests, by_time))
        below = 1 << (n.bit_length() - 1)
        if below < n and below >= self.min_measured_requests \
                and P99Rule(self.confidence).sequential(n).min_samples_to_pass() > n:
            return below
        return n


@dataclass(frozen=True)
class QpsSearchConfig:
    """The bracketing search (``relaygr.bench.qps_search.QpsSearch``)."""

    start_qps: float = 2.0
    growth: float = 2.0
    rel_tol: float = 0.1     # stop when the bracket is within 10%
    # Seconds of measuring one mode's search may take: a bound on time, not on trials (a few
    # passing points of ~500 requests each, and the fails, which stop early).
    budget_s: float = 600.0
    min_qps: float = 0.25
    max_qps: float = 2000.0

    def __post_init__(self) -> None:
        if not self.budget_s > 0:
            raise ConfigError(f"budget_s must be > 0, got {self.budget_s}")
        if not self.growth > 1:
            raise ConfigError(f"growth must be > 1, got {self.growth}")

    def started_near(self, rate_qps: float) -> QpsSearchConfig:
        """This search started at the highest rate ``start_qps * growth ** k`` (k >= 0) at or
        below both ``rate_qps`` and ``max_qps``: on the grid it would climb anyway, so the
        rates stay comparable between runs and machines (itself when ``rate_qps`` is not a
        finite rate above ``start_qps``)."""
        target = min(rate_qps, self.max_qps) if math.isfinite(rate_qps) else math.nan
        if not target > self.start_qps:
            return self
        steps = math.floor(math.log(target / self.start_qps, self.growth) + 1e-9)
        return replace(self, start_qps=self.start_qps * self.growth ** steps)


@dataclass(frozen=True)
class SweepConfig:
    """Max sequence length under SLO: the length grid and the fixed offered load.

    Every mode's sweep starts at ``start`` (None: the shortest length; see ``LengthSweep``).
    ``coarse_modes`` sweep every ``coarse_stride``-th length of the grid only (the lengths
    ``start`` is among): modes whose bar is not on length, at a fraction of the cost.
    ``budget_s``: seconds of measuring each mode's sweep may spend (``LengthSweep``).
    ``rel_tol`` (None: the grid's answer): how narrow the sweeps of the modes not coarse make
    the bracket the grid leaves, by midpoints on multiples of ``quantum_tokens``
    (``LengthSweep``): the modes whose bar is on length; the coarse ones stop at their grid's
    bracket. ``modes`` (None: every mode of the run) are the modes swept at all.
    """

    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    qps: float = 2.0
    start: int | None = None
    coarse_modes: tuple[str, ...] = ()
    coarse_stride: int = 2
    budget_s: float = math.inf
    rel_tol: float | None = None
    # the synthetic workloads' lengths are whole tokens; 16 keeps midpoints on round figures
    quantum_tokens: int = 16
    modes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.start is not None and self.start not in self.lengths:
            raise ConfigError(f"sweep start {self.start} is not on the grid {self.lengths}")
        if self.coarse_stride < 1:
            raise ConfigError("coarse_stride must be >= 1")
        if not self.budget_s > 0:
            raise ConfigError(f"sweep budget_s must be > 0, got {self.budget_s}")
        if (self.rel_tol is not None and not self.rel_tol > 0) or self.quantum_tokens < 1:
            raise ConfigError(f"sweep rel_tol must be > 0 (or None) and quantum_tokens >= 1, "
                              f"got {self.rel_tol} and {self.quantum_tokens}")

    def grid(self, mode: str) -> tuple[int, ...]:
        """The lengths ``mode`` is swept over."""
        if mode not in self.coarse_modes:
            return self.lengths
        anchor = 0 if self.start is None else self.lengths.index(self.start)
        return self.lengths[anchor % self.coarse_stride::self.coarse_stride]

    def search(self, mode: str) -> LengthSweep:
        """``mode``'s sweep: its grid, the start, the budget, and narrowing unless coarse."""
        return LengthSweep(self.grid(mode), self.start, self.budget_s,
                           None if mode in self.coarse_modes else self.rel_tol,
                           self.quantum_tokens)

    def swept(self, modes: Sequence[str]) -> tuple[str, ...]:
        """Which of the run's ``modes`` are swept, in the run's order."""
        return tuple(m for m in modes if self.modes is None or m in self.modes)


@dataclass(frozen=True)
class ThroughputConfig:
    """SLO-compliant throughput at a fixed prefix length.

    ``prefix_len`` None means: the operating point of this machine
    (``relaygr.bench.operating``), the length at which the baseline's full ranking pass alone
    takes ``slo_share`` of the SLO, measured through the run's cost probe over ``lengths``;
    without a probe (or with ``slo_share`` None), the longest sweep length at which
    ``baseline`` met the SLO, else the first grid length. At the operating point the
    baseline's systems run with the batch cap the probe found best there
    (``OperatingPoint.baseline_batch``).
    """

    prefix_len: int | None = None
    search: QpsSearchConfig = field(default_factory=QpsSearchConfig)
    # Half the SLO for the pass, half for the wait behind other work at the P99: a stage near
    # its length cap (a longer history would not leave room for the queueing any load brings).
    slo_share: float | None = 0.5
    lengths: LengthSearch = field(default_factory=LengthSearch)
    # At the operating point, every mode's search starts at its grid's highest rate at or
    # below this share of the baseline's compute capacity there
    # (OperatingPoint.baseline_requests_per_s; QpsSearchConfig.started_near): a point far below
    # the answer costs the most time (its requests come slowest) and decides nothing. None:
    # from search.start_qps.
    start_capacity_share: float | None = None

    def __post_init__(self) -> None:
        if self.slo_share is not None and not 0 < self.slo_share < 1:
            raise ConfigError(f"slo_share must be in (0, 1), got {self.slo_share}")
        if self.start_capacity_share is not None and not 0 < self.start_capacity_share <= 1:
            raise ConfigError("start_capacity_share must be in (0, 1], got "
                              f"{self.start_capacity_share}")

    def search_near(self, capacity_rps: float | None) -> QpsSearchConfig:
        """``search`` started near ``start_capacity_share`` of ``capacity_rps`` (the
        baseline's requests a second at the operating point; None: not measured)."""
        if self.start_capacity_share is None or capacity_rps is None:
            return self.search
        return self.search.started_near(self.start_capacity_share * capacity_rps)


@dataclass(frozen=True)
class MixedConfig:
    """SLO-compliant throughput on a mixed-length workload (source by name, its params).

    ``search`` None: the workload is not searched (it still serves the exactness replay)."""

    source: str = "synthetic"
    params: Mapping[str, Any] = field(default_factory=dict)
    search: QpsSearchConfig | None = field(default_factory=QpsSearchConfig)


@dataclass(frozen=True)
class LimitConfig:
    """The low-load point of ``mode`` whose P50 ranking latency is set against the isolated
    cached ranking latency (at the throughput prefix length)."""

    mode: str = "relay"
    qps: float = 1.0
    requests: int = 100
    warmup_requests: int = 10
    # None: the throughput phase's prefix length.
    prefix_len: int | None = None


@dataclass(frozen=True)
class ExactnessConfig:
    """Replay the first ``requests`` of the mixed workload at ``qps`` through two modes."""

    reference: str = "baseline"
    candidate: str = "relay"
    requests: int = 32
    qps: float = 1.0


@dataclass(frozen=True)
class WorkloadPhaseConfig:
    """SLO-compliant throughput of a few systems on one more workload (by source name).

    ``modes`` name factories given to ``run_benchmark`` either as modes or as extra systems
    (e.g. a relay without cross-request reuse, for MLPerf's closed rules).
    """

    name: str
    source: str
    params: Mapping[str, Any] = field(default_factory=dict)
    modes: tuple[str, ...] = ("baseline", "relay")
    search: QpsSearchConfig = field(default_factory=QpsSearchConfig)


@dataclass(frozen=True)
class BenchConfig:
    """A whole benchmark run. A phase set to None is skipped.

    ``population`` is the synthetic population of the sweep and the fixed-length throughput
    search (its length distribution is replaced by the fixed length of each point).
    ``model`` is reported and used for FLOP counts.
    """

    slo_ms: float = 50.0
    seed: int = 0
    device: str = "cpu"
    # Where the systems' ranking instances run (reported): "threads" (a worker thread each, in
    # the benchmark's process) or "processes" (a process each).
    instance_placement: str = "threads"
    population: SyntheticConfig = field(default_factory=SyntheticConfig)
    budget: PointBudget = field(default_factory=PointBudget)
    sweep: SweepConfig | None = field(default_factory=SweepConfig)
    throughput: ThroughputConfig | None = field(default_factory=ThroughputConfig)
    mixed: MixedConfig | None = field(default_factory=MixedConfig)
    limit: LimitConfig | None = field(default_factory=LimitConfig)
    exactness: ExactnessConfig | None = field(default_factory=ExactnessConfig)
    model: HSTUConfig | None = None
    measure_matmul_peak: bool = True
    workloads: tuple[WorkloadPhaseConfig, ...] = ()
    # How the modes' systems serve (instances, threads per instance, batch size): reported with
    # the operating point, not used to build anything.
    serving: Mapping[str, Any] = field(default_factory=dict)
    # Seconds from the run's start by which the searching phases end (None: no deadline, each
    # search bounded by its own budget): ``relaygr.bench.suite``.
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if not self.slo_ms > 0:
            raise ConfigError(f"slo_ms must be > 0, got {self.slo_ms}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ConfigError(f"deadline_s must be > 0, got {self.deadline_s}")
        if self.instance_placement not in ("threads", "processes"):
            raise ConfigError("instance_placement must be 'threads' or 'processes', got "
                              f"{self.instance_placement!r}")

    @classmethod
    def full(cls, **changes: Any) -> BenchConfig:
        """The full run (defaults): up to 2,000 measured requests per point, 6 lengths,
        searches of 10 minutes."""
        return replace(cls(), **changes)

    @classmethod
    def quick(cls, **changes: Any) -> BenchConfig:
        """A smoke run: verdicts at 90% confidence over at most 230-256 requests a point (a
        pass needs 230 without an overage), 5 lengths, searches of 2 minutes, small replays."""
        search = QpsSearchConfig(rel_tol=0.2, budget_s=120.0)
        base = cls(budget=PointBudget(measured_requests=256, min_measured_requests=230,
                                      warmup_requests=20, max_point_s=10.0, confidence=0.9),
                   sweep=SweepConfig(lengths=(512, 1024, 2048, 4096, 8192)),
                   throughput=ThroughputConfig(search=search),
                   mixed=MixedConfig(search=search),
                   limit=LimitConfig(requests=50, warmup_requests=5),
                   exactness=ExactnessConfig(requests=16))
        return replace(base, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchConfig:
        return load(cls, data)
