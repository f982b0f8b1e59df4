"""Instance processes that die, hang, raise or cannot be built: failover, restarts, stops."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from relaygr.cascade.instances import build_instance
from relaygr.cascade.visit import Recommendation
from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.transport import process_instance
from relaygr.engine.transport.host import HostSpec
from relaygr.engine.transport.host_link import HostLink
from relaygr.engine.transport.processes import InstanceProcesses
from relaygr.engine.transport.supervisor import SupervisorPolicy
from relaygr.routing import rendezvous_order
from tests.cascade.test_system import NUM_ITEMS, serve, visits
from tests.engine.helpers import failing_passes, flops_cost_model
from tests.engine.test_processes import _processes, _run, _system
from tests.model.helpers import make_model
from tests.tolerance import SCORE_TOL

# Spawns, kills and restarts instance processes: slow, and run by CI with -m slow.
pytestmark = pytest.mark.slow


def test_a_dead_process_fails_over_to_the_next_instance() -> None:
    processes = _processes()
    plan = visits(count=20)

    async def main() -> list[Recommendation]:
        system = _system("relay", processes)
        await system.start()
        await system.supervisor.stop()      # no restart here: the routing around is the test
        try:
            out = [await system.recommend(v) for v in plan[:5]]
            pid = processes.pids()[0]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            while system.instances[0].healthy:
                await asyncio.sleep(0.01)
            assert not system.instances[0].snapshot().healthy   # what /readyz and metrics read
            out += [await system.recommend(v) for v in plan[5:]]
            assert {r.instance for r in out[5:]} == {"rank-1"}
            return out
        finally:
            await system.stop()

    got = _run(processes, main)
    want, _ = serve("baseline", plan)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.scores, w.scores, atol=SCORE_TOL, rtol=SCORE_TOL)


def passes_of_rank_0_raise(config: Any, name: str, device: str, model: Any,
                           cost_model: Any) -> Any:
    """``build_instance``, whose instance rank-0's ranking passes raise (in its host process,
    as a device error would there)."""
    instance = build_instance(config, name, device, model, cost_model)
    if name == "rank-0":
        failing_passes(instance, RuntimeError("CUDA error: an illegal memory access was "
                                              "encountered (injected)"))
    return instance


def test_an_instance_whose_passes_raise_in_its_process_is_answered_around() -> None:
    """The host sends the pass's error back; the parent's fleet fails the leg over (the next
    instance answers with the full pass's scores) and, after three in a row, its breaker takes
    rank-0 out, naming the error that crossed the process boundary."""
    model = make_model(0, num_items=NUM_ITEMS)
    processes = InstanceProcesses.for_model(model, flops_cost_model(model.cfg), 2,
                                            build=passes_of_rank_0_raise)
    plan = [v for v in visits(seed=7, count=40)
            if rendezvous_order(v.user_id, ["rank-0", "rank-1"])[0] == "rank-0"][:4]

    async def main() -> list[Recommendation]:
        system = _system("relay", processes)
        await system.start()
        try:
            out = [await system.recommend(v) for v in plan]
            assert system.counters.instance_errors == system.counters.failovers == 3
            assert [v.healthy for v in system.fleet.views()] == [False, True]
            reason = system.fleet.snapshots()[0].unhealthy_reason
            assert reason is not None and "RuntimeError: CUDA error" in reason
            return out
        finally:
            await system.stop()

    got = _run(processes, main)
    want, _ = serve("baseline", plan)
    assert {r.instance for r in got} == {"rank-1"}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.scores, w.scores, atol=SCORE_TOL, rtol=SCORE_TOL)


def test_the_supervisor_restarts_a_killed_instance_process() -> None:
    processes = _processes()
    plan = visits(count=12)

    async def main() -> tuple[list[Recommendation], list[Recommendation]]:
        system = _system("relay", processes)
        await system.start()
        try:
            before = [await system.recommend(v) for v in plan[:6]]
            pid = processes.pids()[0]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            # a hang guard, not a verdict: the restart takes a process start (seconds)
            deadline = time.monotonic() + 120
            while system.supervisor.counts.restarts == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert system.instances[0].healthy and processes.pids()[0] not in (None, pid)
            counts = system.supervisor.counts
            assert (counts.deaths, counts.restarts, counts.given_up) == (1, 1, [])
            after = [await system.recommend(v) for v in plan[6:]]
            assert "rank-0" in {r.instance for r in before + after}
            return before, after
        finally:
            await system.stop()

    before, after = _run(processes, main)
    want, _ = serve("baseline", plan)
    for g, w in zip(before + after, want, strict=True):
        torch.testing.assert_close(g.scores, w.scores, atol=SCORE_TOL, rtol=SCORE_TOL)


_FAIL_BUILD = "RELAYGR_TEST_FAIL_BUILD"


def failing_after_a_flag(config: Any, name: str, device: str, model: Any,
                         cost_model: Any) -> Any:
    """``build_instance``, until the flag is in the environment a host process starts with (as
    an arena allocation could start failing on a machine whose memory ran short)."""
    if os.environ.get(_FAIL_BUILD):
        raise MemoryError("arena allocation failed (injected)")
    return build_instance(config, name, device, model, cost_model)


def test_a_restart_whose_instance_cannot_be_built_stays_down_and_is_given_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The new host process starts but cannot open the instance: the instance is not healthy
    (it was reported healthy, open nowhere, and never tried again), each try counts as a
    failed restart, and the supervisor gives up after its limit."""
    model = make_model(0, num_items=NUM_ITEMS)
    processes = InstanceProcesses.for_model(model, flops_cost_model(model.cfg), 2,
                                            build=failing_after_a_flag)

    async def main() -> None:
        system = _system("relay", processes)
        system.supervisor.policy = SupervisorPolicy(interval_s=0.05, backoff_s=0.05,
                                                    max_backoff_s=0.1, max_restarts=2)
        await system.start()
        try:
            monkeypatch.setenv(_FAIL_BUILD, "1")       # the hosts started from now on
            pid = processes.pids()[0]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 120        # a hang guard: two process starts
            while not system.supervisor.counts.given_up and time.monotonic() < deadline:
                assert system.instances[0].snapshot().healthy is False or \
                    processes.pids()[0] == pid        # never healthy once its host died
                await asyncio.sleep(0.02)
            counts = system.supervisor.counts
            assert counts.given_up == ["rank-0"] and counts.failed_restarts == 2
            assert not system.instances[0].healthy and counts.restarts == 0
            out = [await system.recommend(v) for v in visits(count=4)]
            assert {r.instance for r in out} == {"rank-1"}
        finally:
            await system.stop()

    _run(processes, main)


def test_a_stop_ends_even_when_a_host_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host stopped (SIGSTOP) at shutdown is killed once its instance's stop times out;
    the system's stop returns instead of waiting for it for good."""
    monkeypatch.setattr(process_instance, "STOP_TIMEOUT_S", 1.0)
    processes = _processes()

    async def main() -> float:
        system = _system("relay", processes)
        await system.start()
        await system.recommend(visits(count=1)[0])
        pid = processes.pids()[0]
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        await asyncio.wait_for(system.stop(), 60)     # a hang guard, not the verdict
        return time.monotonic() - started

    took = _run(processes, main)
    assert took < 30          # bounded by the stop timeout (1 s), not by the host


def test_a_host_killed_as_it_starts_fails_its_start_instead_of_blocking_it() -> None:
    """The host's spec (the model's weights) travels over its socket after the spawn: a
    child killed before reading it fails the start at once; sent with the spawn, the parent's
    write of a payload larger than a pipe holds blocked for good."""
    model = make_model(0, num_items=20_000)       # weights far larger than a pipe's buffer
    link = HostLink(0, HostSpec.of(model, flops_cost_model(model.cfg), build_instance, 1),
                    start_timeout_s=60.0)

    async def main() -> None:
        before = _children()
        starting = asyncio.ensure_future(link.ensure_started())
        while not (new := _children() - before):     # the child, as soon as it exists
            await asyncio.sleep(0.001)
        for pid in new:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(InstanceStoppedError, match="failed to start"):
            await asyncio.wait_for(starting, 30)      # a hang guard: the start blocked

    loop = asyncio.new_event_loop()       # closed without waiting for a start that blocked
    try:
        loop.run_until_complete(main())
    finally:
        link.terminate()
        loop.close()


def _children() -> set[int]:
    """Process ids whose parent is this process (from /proc)."""
    me, found = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found.add(int(stat.parent.name))
    return found
