"""The machine's noise during a point, and what the benchmark does about it.

A shared VM slows a point down when a neighbour runs: the hypervisor steals CPU time (Linux
``/proc/stat``), or, where steal is not reported, the same fixed workload simply takes longer.
``NoiseMonitor`` reads both around each point: the steal share during the point and a
calibration timing right after it (``hardware.calibration_ms``), judged against the best
calibration of the run. A point that did not pass under noise is measured again (the suite's
rule); noise only slows a system down, so a pass under noise stands.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from relaygr.bench.hardware import CpuTimes, calibration_ms, cpu_times, steal_fraction


@dataclass(frozen=True)
class PointNoise:
    """The noise measured over one point: stolen CPU share (None: not reported) and the
    calibration workload's time right after it."""

    steal_fraction: float | None
    calibration_ms: float

    def describe(self) -> str:
        steal = "steal n/a" if self.steal_fraction is None else \
            f"{self.steal_fraction:.0%} steal"
        return f"{steal}, calibration {self.calibration_ms:.2f} ms"


class NoiseMonitor:
    """Measures each point's noise and says whether it was too much to believe a miss.

    Too much: more than ``max_steal`` of the CPU stolen, or a calibration more than
    ``max_slowdown`` x the best one this monitor has seen."""

    def __init__(self, max_steal: float, max_slowdown: float) -> None:
        self.max_steal, self.max_slowdown = max_steal, max_slowdown
        self.best_calibration_ms = math.inf

    def begin(self) -> CpuTimes | None:
        return cpu_times()

    def end(self, before: CpuTimes | None) -> PointNoise:
        steal = steal_fraction(before, cpu_times())
        calibration = calibration_ms()
        self.best_calibration_ms = min(self.best_calibration_ms, calibration)
        return PointNoise(steal, calibration)

    def too_noisy(self, steal: float | None, calibration: float | None) -> bool:
        if steal is not None and steal > self.max_steal:
            return True
        return calibration is not None and \
            calibration > self.max_slowdown * self.best_calibration_ms


# How long a re-measure waits at most for the host to quieten.
QUIET_PATIENCE_S = 120.0


async def wait_for_quiet_host(max_steal: float, window_s: float = 5.0,
                              patience_s: float = QUIET_PATIENCE_S) -> bool:
    """Wait until a ``window_s`` window with at most ``max_steal`` of the CPU time stolen (True),
    or ``patience_s`` passed (False): a noisy neighbour's burst usually lasts minutes."""
    waited = 0.0
    while waited < patience_s:
        before = cpu_times()
        window = min(window_s, patience_s - waited)     # never past the patience given
        await asyncio.sleep(window)
        waited += window
        steal = steal_fraction(before, cpu_times())
        if steal is None or steal <= max_steal:
            return True
    return False
