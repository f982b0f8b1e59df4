"""Hardware reference points measured in the same run as the figures they qualify.

``matmul_peak_gflops`` is the best dense-matmul rate this device reaches in the benchmark's
dtype: the denominator of every "achieved fraction of peak". ``time_call`` is the one timing
primitive the profiler and benchmark use (median of repeats, CUDA-synchronised).
``cpu_times`` / ``steal_fraction``: the share of CPU time the hypervisor gave to other guests
during a point (Linux ``/proc/stat``), so a point a noisy neighbour spoiled can be told apart.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


def describe_device(device: torch.device | str = "cpu") -> str:
    """A human-readable name of the device figures were measured on (for reports)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Wall-clock milliseconds of repeated calls (after warm-up)."""

    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int
    # Minor page faults of the whole process per timed call: memory mapped and touched afresh
    # (what the host allocator's tuning and the score-block bound exist to avoid). 0 where the
    # platform does not count them.
    page_faults_per_call: float = 0.0


def time_call(fn: Callable[[], object], device: torch.device, repeats: int = 5,
              warmup: int = 1) -> Timing:
    """Median wall time of ``fn`` over ``repeats`` calls, synchronising the device each time."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    faults_before = _minor_faults()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    faults = (_minor_faults() - faults_before) / repeats
    return Timing(statistics.median(samples), min(samples), max(samples), repeats, faults)


def _minor_faults() -> int:
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def matmul_peak_gflops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       sizes: tuple[int, ...] = (1024, 2048), repeats: int = 5) -> float:
    """Best GFLOP/s of square matmuls on ``device`` (larger sizes on CUDA, where peak needs it)."""
    device = torch.device(device)
    if device.type == "cuda":
        sizes = (4096, 8192)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        timing = time_call(lambda: a @ b, device, repeats=repeats, warmup=2)  # noqa: B023
        best = max(best, 2 * n**3 / (timing.min_ms * 1e-3) / 1e9)
    return best


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative jiffies of all CPUs: ``steal`` (time the hypervisor ran someone else while
    this guest wanted to run) and ``total``."""

    steal: int
    total: int


def cpu_times(stat: Path = Path("/proc/stat")) -> CpuTimes | None:
    """The aggregate ``cpu`` line of ``/proc/stat``; None where there is none (not Linux)."""
    try:
        first = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user and nice)
    ticks = [int(x) for x in first[1:9]]
    return CpuTimes(steal=ticks[7] if len(ticks) > 7 else 0, total=sum(ticks))


def steal_fraction(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """Stolen share of the CPU time between two ``cpu_times`` readings (None if unknown)."""
    if before is None or after is None or after.total <= before.total:
        return None
    return (after.steal - before.steal) / (after.total - before.total)
