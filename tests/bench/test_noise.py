"""The noise of a point (``relaygr.bench.noise``): host steal and a slow calibration timing
mark a missed point for re-measuring; steal is read from ``/proc/stat``."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from relaygr.bench import meter as meter_module
from relaygr.bench import noise as noise_module
from relaygr.bench.decision import Verdict
from relaygr.bench.hardware import CpuTimes, cpu_times, steal_fraction
from relaygr.bench.suite import BenchSuite
from relaygr.bench.workload import SyntheticWorkload
from tests.bench.simulated_plan import CONFIG, POPULATION, factory, fake_steal
from tests.virtual_time import run_virtual


def test_a_failing_point_under_host_steal_is_measured_again(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Steal only slows a system down: a point that misses the SLO while the hypervisor took
    10% of the CPU is measured again (up to ``max_remeasures``), every attempt kept; a point
    that misses without steal, or that passes, is measured once."""
    steal = fake_steal(monkeypatch, 0.10)
    waits: list[float] = []

    # the real one polls for up to 2 minutes
    async def no_wait(max_steal: float, patience_s: float = 0.0) -> bool:
        waits.append(max_steal)
        return True

    monkeypatch.setattr(meter_module, "wait_for_quiet_host", no_wait)
    suite = BenchSuite({"baseline": factory("baseline")}, CONFIG)
    heavy = SyntheticWorkload(POPULATION.with_fixed_length(2048), CONFIG.seed)
    stats = asyncio.run(suite.meter.measure("baseline", "sweep", heavy, 2000.0, 2048))
    assert stats.verdict is Verdict.FAIL
    assert [p.attempt for p in suite.points] == [1, 2, 3]
    assert waits == [CONFIG.budget.remeasure_steal] * 2   # a quiet host is awaited each time
    assert all(p.steal_fraction == pytest.approx(0.10, abs=0.01) for p in suite.points)

    steal["share"] = 0.0
    suite.points.clear()
    asyncio.run(suite.meter.measure("baseline", "sweep", heavy, 2000.0, 2048))
    light = SyntheticWorkload(POPULATION.with_fixed_length(128), CONFIG.seed)
    steal["share"] = 0.10
    assert asyncio.run(suite.meter.measure("baseline", "sweep", light, 2000.0, 128)).passed
    assert [p.attempt for p in suite.points] == [1, 1]


def test_a_miss_while_the_calibration_ran_slow_is_measured_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where steal is not reported, a slow calibration timing marks the noise: a point that
    does not pass while the fixed workload took 2x its best time in the run is measured again;
    a pass is never re-measured."""
    fake_steal(monkeypatch, 0.0)
    timings = iter([1.0, 2.0, 1.1])     # ms: the light point, then two attempts of the heavy
    monkeypatch.setattr(noise_module, "calibration_ms", lambda: next(timings))

    async def no_wait(max_steal: float, patience_s: float = 0.0) -> bool:
        return True

    monkeypatch.setattr(meter_module, "wait_for_quiet_host", no_wait)
    config = replace(CONFIG, budget=replace(CONFIG.budget, remeasure_slowdown=1.5))
    suite = BenchSuite({"baseline": factory("baseline")}, config)
    light = SyntheticWorkload(POPULATION.with_fixed_length(128), CONFIG.seed)
    heavy = SyntheticWorkload(POPULATION.with_fixed_length(2048), CONFIG.seed)
    assert asyncio.run(suite.meter.measure("baseline", "sweep", light, 2000.0, 128)).passed
    assert not asyncio.run(suite.meter.measure("baseline", "sweep", heavy, 2000.0, 2048)).passed
    assert [(p.prefix_len, p.attempt, p.calibration_ms) for p in suite.points] == [
        (128, 1, 1.0), (2048, 1, 2.0), (2048, 2, 1.1)]


def test_cpu_times_reads_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\n")
    assert cpu_times(stat) == CpuTimes(steal=40, total=1000)
    assert steal_fraction(CpuTimes(40, 1000), CpuTimes(90, 2000)) == pytest.approx(0.05)
    assert steal_fraction(None, CpuTimes(1, 2)) is None
    assert cpu_times(tmp_path / "missing") is None


def test_waiting_for_a_quiet_host_polls_steal(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([CpuTimes(0, 0), CpuTimes(50, 100), CpuTimes(50, 100), CpuTimes(51, 200)])
    monkeypatch.setattr(noise_module, "cpu_times", lambda: next(readings))
    assert asyncio.run(noise_module.wait_for_quiet_host(0.05, window_s=0.01, patience_s=1.0))
    readings = iter([CpuTimes(0, 0), CpuTimes(50, 100)] * 3)
    assert not asyncio.run(noise_module.wait_for_quiet_host(0.05, window_s=0.01,
                                                            patience_s=0.03))

    async def noisy_for(patience_s: float) -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert not await noise_module.wait_for_quiet_host(0.05, window_s=5.0,
                                                          patience_s=patience_s)
        return loop.time() - start

    # the wait ends at its patience (the time left before a deadline), not a window later
    readings = iter([CpuTimes(0, 0), CpuTimes(50, 100)] * 4)
    assert run_virtual(noisy_for(1.5)) == 1.5
    readings = iter([CpuTimes(0, 0), CpuTimes(50, 100)] * 4)
    assert run_virtual(noisy_for(7.0)) == 7.0
