"""Ranking instances in processes of their own: the same answers as in-process instances, a
fresh instance per system on long-lived processes, and failover when a process dies."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from relaygr.cascade.instances import build_instance
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation
from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.transport import process_instance
from relaygr.engine.transport.host import HostSpec
from relaygr.engine.transport.host_link import HostLink
from relaygr.engine.transport.processes import InstanceProcesses, ProcessInstance
from relaygr.engine.transport.supervisor import SupervisorPolicy
from relaygr.engine.types import PreinferAction, RankPath
from relaygr.errors import ConfigError
from relaygr.routing import rendezvous_order
from tests.cascade.test_system import NUM_ITEMS, config, histories, serve, visits
from tests.engine.helpers import failing_passes, flops_cost_model
from tests.model.helpers import make_model
from tests.tolerance import SCORE_TOL

# Spawns, kills and restarts instance processes: slow, and run by CI with -m slow.
pytestmark = pytest.mark.slow

T = TypeVar("T")


def _system(mode: str, processes: InstanceProcesses, **changes: object) -> RelaySystem:
    model = make_model(0, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    return RelaySystem(config(mode, **changes), model, store, flops_cost_model(model.cfg),
                       instance_factory=processes.factory)


def _processes() -> InstanceProcesses:
    model = make_model(0, num_items=NUM_ITEMS)
    return InstanceProcesses.for_model(model, flops_cost_model(model.cfg), 2,
                                       build=build_instance)


def _run(processes: InstanceProcesses, main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``main()`` on a fresh event loop; the processes end with it, however it ends."""
    try:
        return asyncio.run(main())
    finally:
        processes.close()


async def _serve_all(system: RelaySystem, plan: list) -> list[Recommendation]:
    await system.start()
    try:
        out = [await system.recommend(v) for v in plan]
        await system.wait_idle()
        return out
    finally:
        await system.stop()


def test_process_instances_rank_like_in_process_ones() -> None:
    plan = visits()
    want = {mode: serve(mode, plan)[0] for mode in ("baseline", "relay")}
    processes = _processes()

    async def main() -> dict[str, list[Recommendation]]:
        got = {}
        for mode in ("baseline", "relay"):
            system = _system(mode, processes)
            got[mode] = await _serve_all(system, plan)
            assert all(isinstance(i, ProcessInstance) for i in system.instances)
        return got

    got = _run(processes, main)
    for mode in ("baseline", "relay"):
        for g, w in zip(got[mode], want[mode], strict=True):
            assert torch.equal(g.candidates, w.candidates)
            assert g.scores.dtype == w.scores.dtype
            if mode == "baseline":      # the same full pass, computed in another process
                assert g.path is RankPath.FULL and torch.equal(g.scores, w.scores)
            else:
                torch.testing.assert_close(g.scores, w.scores, atol=SCORE_TOL, rtol=SCORE_TOL)
            # where the time went crosses the process boundary, with the hop measured
            assert g.timing is not None and g.timing.compute_s > 0
            assert g.timing.transport_s >= 0 and g.timing.batch_size >= 1
    relay_paths = {r.path for r in got["relay"]}
    assert relay_paths & {RankPath.DEVICE_HIT, RankPath.PENDING_WAIT, RankPath.HOST_HIT}
    assert all(r.preinfer is not None for r in got["relay"])


def test_each_system_gets_fresh_instances_on_the_same_processes() -> None:
    processes = _processes()
    plan = visits(count=12)

    async def main() -> None:
        first = _system("relay", processes)
        await _serve_all(first, plan)
        pids = processes.pids()
        second = _system("relay", processes)
        await second.start()
        try:
            for inst in second.instances:
                assert isinstance(inst, ProcessInstance)
                snap = await inst.refresh()
                assert snap.healthy and snap.device is not None
                assert snap.device.entries == 0 and not snap.paths   # nothing inherited
            await second.recommend(plan[0])
            await second.wait_idle()
            for inst in second.instances:
                await inst.check_integrity()
            served = 0
            for inst in second.instances:
                assert isinstance(inst, ProcessInstance)
                served += sum((await inst.refresh()).paths.values())
            assert served == 1
        finally:
            await second.stop()
        assert processes.pids() == pids      # no process was started for the second system

    _run(processes, main)


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


def test_fail_and_restart_reach_the_instance_in_its_process() -> None:
    processes = _processes()
    plan = visits(count=16)

    async def main() -> None:
        system = _system("relay", processes)
        await system.start()
        try:
            await system.recommend(plan[0])
            await system.fail_instance("rank-0")
            assert not system.instances[0].healthy
            out = [await system.recommend(v) for v in plan[1:8]]
            assert {r.instance for r in out} == {"rank-1"}
            await system.restart_instance("rank-0")
            assert system.instances[0].healthy
            out = [await system.recommend(v) for v in plan[8:]]
            assert "rank-0" in {r.instance for r in out}
            await system.wait_idle()
            for inst in system.instances:
                await inst.check_integrity()
        finally:
            await system.stop()

    _run(processes, main)


def test_a_factory_refuses_a_model_its_processes_do_not_serve() -> None:
    processes = _processes()
    other = make_model(1, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    with pytest.raises(ConfigError, match="different model"):
        RelaySystem(config("relay"), other, store, flops_cost_model(other.cfg),
                    instance_factory=processes.factory)
    assert processes.pids() == [None, None]     # nothing was started


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



def test_an_abandon_reaches_the_instance_in_its_process() -> None:
    """``AbandonCall`` crosses the process boundary: a pre-infer whose ranking leg will not come
    is cancelled or kept unleased there, and holds no footprint after."""
    processes = _processes()

    async def main() -> tuple[bool, bool, dict[str, int], int]:
        system = _system("relay", processes)
        await system.start()
        try:
            rank_0 = system.instances[0]
            assert isinstance(rank_0, ProcessInstance)
            spec, _ = system.path._prefix_spec(3, 0)
            result = await rank_0.preinfer(spec, 0, 24)
            assert result.action is PreinferAction.PREFILL
            first = await rank_0.abandon(spec.pid)
            again = await rank_0.abandon(spec.pid)     # nothing left to free
            await rank_0.idle()
            snap = await rank_0.refresh()
            assert snap.device is not None
            return first, again, snap.residency, snap.device.unevictable_bytes
        finally:
            await system.stop()

    first, again, residency, unevictable = _run(processes, main)
    assert first and not again
    assert residency["preinfers_cancelled"] + residency["preinfers_unleased"] == 1
    assert unevictable == 0
