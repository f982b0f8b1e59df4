"""Hardware reference points measured in the same run as the figures they qualify.

``matmul_peak_gflops`` is the best dense-matmul rate this device reaches in the benchmark's
dtype: the denominator of every "achieved fraction of peak", timed with ``relaygr.timing``.
``cpu_times`` / ``steal_fraction``: the share of CPU time the hypervisor gave to other guests
during a point (Linux ``/proc/stat``), so a point a noisy neighbour spoiled can be told apart;
``calibration_ms`` times a fixed workload, the same check where steal is not reported.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from relaygr.timing import time_call


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


def elementwise_rate_gelems(device: torch.device | str = "cpu",
                           dtype: torch.dtype = torch.float32, elems: int = 1 << 20,
                           repeats: int = 9) -> float:
    """Billions of attention-score elements per second this device takes through the
    element-wise steps HSTU applies to each (bias add, SiLU, in place), on a block of ``elems``
    (the default is ``score_block_elems``: the size the serving passes keep their score blocks
    to). The time such work cannot go below, beside the matmul peak: like the peak, the best of
    the timed calls (a median would count a neighbour's burst on a shared machine as the
    device's rate)."""
    device = torch.device(device)
    scores = torch.randn(elems, device=device, dtype=dtype)
    bias = torch.randn(elems, device=device, dtype=dtype)

    def step() -> None:
        torch.nn.functional.silu(scores.add_(bias), inplace=True)

    timing = time_call(step, device, repeats=repeats, warmup=2)
    return elems / (timing.min_ms * 1e-3) / 1e9


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


def calibration_ms(repeats: int = 3) -> float:
    """Best of ``repeats`` timings of a fixed CPU workload (sorting 200,000 seeded floats, a
    few ms): read beside its best time in the run, how much slower this machine is right now."""
    values = np.random.default_rng(0).random(200_000)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.sort(values, kind="quicksort")
        best = min(best, time.perf_counter() - start)
    return best * 1e3
