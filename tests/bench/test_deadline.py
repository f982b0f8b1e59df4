"""The run's deadline on the simulated plan, on a virtual clock (``tests.virtual_time``): every
point of the sweep and the searches ends by it, whatever the machine's speed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import pytest

from relaygr.bench.progress import NullProgress
from relaygr.bench.protocol import SystemContext
from relaygr.bench.report import BenchReport
from relaygr.bench.suite import BenchSuite
from tests.bench.fakes import SimulatedServer
from tests.bench.simulated_plan import CONFIG, PATHS, SERVICE, fake_steal
from tests.virtual_time import run_virtual


class _PointEnds(NullProgress):
    """A ``Progress`` that keeps the loop's clock at the end of every point."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.notes: list[str] = []

    def end_point(self) -> None:
        self.ends.append(asyncio.get_running_loop().time())

    def note(self, text: str) -> None:
        self.notes.append(text)


class _SlowStart(SimulatedServer):
    """A simulated server that takes 0.2 s (of the loop's clock) to start."""

    async def start(self) -> None:
        await asyncio.sleep(0.2)       # on the virtual clock: no real time passes
        await super().start()


@pytest.mark.parametrize("steal", [0.0, 0.10])
def test_the_runs_deadline_ends_the_searches_in_time_and_says_so(
        monkeypatch: pytest.MonkeyPatch, steal: float) -> None:
    """On the loop's virtual clock, with systems that take a while to start: unbounded, the
    sweep and the throughput search take some time T; with a deadline of half of it every
    point ends by the deadline (a point, or its re-measure under noise, starts only when its
    schedule plus the longest set-up and drain so far fit), a search cut short says
    ``deadline``, and the phases after it still run. Under steal every point that did not
    pass waits for a quiet host, no longer than the deadline allows, and is measured again
    only when it still fits."""
    fake_steal(monkeypatch, steal)
    config = replace(CONFIG, mixed=None, exactness=None,
                     budget=replace(CONFIG.budget, max_remeasures=1))

    def slow(mode: str) -> Callable[[SystemContext], SimulatedServer]:
        return lambda ctx: _SlowStart(ctx, SERVICE[mode], PATHS[mode])

    systems = {m: slow(m) for m in ("baseline", "relay")}

    async def timed(deadline_s: float | None) -> tuple[BenchReport, list[float], list[str]]:
        ends = _PointEnds()
        suite = BenchSuite(systems, replace(config, deadline_s=deadline_s), progress=ends)
        start = asyncio.get_running_loop().time()
        report = await suite.run()
        searched = [e - start for e, p in zip(ends.ends, suite.points, strict=True)
                    if p.phase in ("sweep", "throughput")]
        return report, searched, ends.notes

    free, free_ends, _ = run_virtual(timed(None))
    assert all(r.stopped_by != "deadline"
               for m in free.modes.values() for r in (m.sweep, m.throughput) if r is not None)
    took = max(free_ends)
    cut, ends, notes = run_virtual(timed(took / 2))
    assert max(ends) <= took / 2
    if steal:       # a point that did not pass waited for a quiet host until it no longer fit
        assert any("would end past the run's deadline" in n for n in notes)
        assert any(p.attempt == 2 for p in free.points)
    assert len(ends) < len(free_ends)
    stopped = [r.stopped_by for m in cut.modes.values() for r in (m.sweep, m.throughput)
               if r is not None]
    assert "deadline" in stopped
    assert cut.limit is not None                     # the fixed phases after it still ran
