"""The instance cost probe on a tiny model, in real processes: each layout's processes are set
up as instance hosts (their worker computes on the layout's threads), every instance of the
layout answers each timing call, and ``close`` ends them. Timings are only checked to be
measured (positive), never against a speed."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch

from relaygr.bench import instance_probe
from relaygr.bench.instance_probe import InstanceCostProbe
from relaygr.bench.layout import Layout
from relaygr.bench.limit import LimitProbe
from relaygr.bench.operating import LayoutProbe
from relaygr.errors import ConfigError
from relaygr.model import HSTU, HSTUConfig


def test_layouts_are_timed_in_processes_set_up_as_instances() -> None:
    torch.manual_seed(0)
    model = HSTU(HSTUConfig(num_items=50, dim=16, num_layers=1, num_heads=1)).eval()
    probe = InstanceCostProbe(model, Layout(2, 1), repeats=2, warmup=1)
    assert isinstance(probe, LayoutProbe)
    limit: LimitProbe = probe                  # the limit's probe too (checked by mypy)
    try:
        ms = probe.full_rank_ms(32, 2, 8)
        other = probe.layout_rank_ms(Layout(1, 2), 32, 2, 8, batch=2)
        cached = limit.cached_rank_samples_ms(32, 2, 8, 3)   # one process of 1 thread, alone
        assert len(cached) == 3
        # the cost curve's passes: each of the 2 processes times half of 5, rounded up
        curve = probe.full_rank_samples_ms(32, 2, 8, 5)
        assert len(curve) == 6
        assert all(math.isfinite(v) and v > 0 for v in (ms, other, *cached, *curve))
        groups = probe._groups
        assert set(groups) == {Layout(2, 1), Layout(1, 2), Layout(1, 1)}
        assert len(groups[Layout(1, 1)].time(("cached", 32, 2, 8, 1, 3, 0, 0.0))) == 3
        # the worker thread of each process computes on its layout's threads
        assert groups[Layout(2, 1)].worker_threads == [1, 1]
        assert groups[Layout(1, 2)].worker_threads == [2]
        # each instance's passes: 2 processes x 2 repeats
        assert len(groups[Layout(2, 1)].time(("full", 32, 2, 8, 1, 2, 0, 0.0))) == 4
        procs = [p for g in groups.values() for p in g.procs]
    finally:
        probe.close()
    assert not any(p.is_alive() for p in procs) and probe._groups == {}


def test_bad_settings_are_refused() -> None:
    model = HSTU(HSTUConfig(num_items=50, dim=16, num_layers=1, num_heads=1)).eval()
    with pytest.raises(ConfigError):
        InstanceCostProbe(model, Layout(1, 1), repeats=0)
    with pytest.raises(ConfigError):
        InstanceCostProbe(model, Layout(1, 1), limit_pace_s=-1.0)


def test_a_paced_call_idles_before_each_timed_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # the probe process's loop, run here: which sleeps it asks for, recorded, not waited
    slept: list[float] = []

    async def record(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(instance_probe.asyncio, "sleep", record)
    executor = instance_probe.ComputeExecutor("probe", torch.device("cpu"))
    calls: list[int] = []
    try:
        ms = asyncio.run(instance_probe._passes(executor, lambda: calls.append(1),
                                                threading.Barrier(1), 2, 1, 0.2))
        assert (len(ms), len(calls), slept) == (2, 3, [0.2, 0.2])   # none before the warm-up
        slept.clear()
        asyncio.run(instance_probe._passes(executor, lambda: None, threading.Barrier(1), 2, 1))
        assert slept == []
    finally:
        executor.shutdown()
