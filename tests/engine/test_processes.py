"""Instances in processes of their own: in-process answers, fresh instances, calls reaching them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
import torch

from relaygr.cascade.instances import build_instance
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation
from relaygr.engine.transport.processes import InstanceProcesses, ProcessInstance
from relaygr.engine.types import PreinferAction, RankPath
from relaygr.errors import ConfigError
from tests.cascade.test_system import NUM_ITEMS, config, histories, serve, visits
from tests.engine.helpers import flops_cost_model
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
                assert g.path is RankPath.FULL
            # equal to float32 rounding, not bit for bit: the host process runs torch on one
            # thread (HostSpec.torch_threads) and this one on up to two, and a CPU's matmul
            # kernels may split a reduction differently by thread count
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
