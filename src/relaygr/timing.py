"""The one timing primitive of the project: median wall time of repeated calls on a device.

Used by the profiler, the benchmark and the trigger's start-up cost-model fit. CUDA calls are
synchronised around each timed call, so a figure is the work's, not its launch's. It sits at the
bottom of the layers (beside ``errors``) because both the relay and the benchmark measure with it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


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
    samples_ms: tuple[float, ...] = ()      # every timed call, in order


def time_call(fn: Callable[[], object], device: torch.device, repeats: int = 5,
              warmup: int = 1, pace_s: float = 0.0) -> Timing:
    """Median wall time of ``fn`` over ``repeats`` calls, synchronising the device each time;
    each timed call after ``pace_s`` of idling (0: back to back)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    faults_before = _minor_faults()
    for _ in range(repeats):
        if pace_s > 0:
            time.sleep(pace_s)
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    faults = (_minor_faults() - faults_before) / repeats
    return Timing(statistics.median(samples), min(samples), max(samples), repeats, faults,
                  tuple(samples))


def _minor_faults() -> int:
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
