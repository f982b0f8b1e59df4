"""An instance whose ranking passes raise: its requests are answered elsewhere with the full
pass's scores, counted; its circuit breaker takes it out of routing and a probe brings it back;
a request's own error is neither failed over nor held against the instance.

The breakers run on a clock the test moves (``InstanceFleet.clock``); nothing waits on time."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relaygr.bench.protocol import RunClock
from relaygr.bench.systems import CascadeUnderTest
from relaygr.cascade.breaker import BreakerState
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.engine.types import RankPath
from relaygr.errors import NoHealthyInstanceError, SequenceTooLongError
from relaygr.routing import rendezvous_order
from tests.cascade.test_system import (
    NUM_ITEMS,
    config,
    histories,
    ranking_instances,
    serve,
    visits,
)
from tests.engine.helpers import failing_passes, flops_cost_model
from tests.model.helpers import make_model
from tests.tolerance import SCORE_TOL

DEVICE_ERROR = RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
COOL_DOWN_S = 10.0      # the default


class Clock:
    """The breakers' clock, moved by the test."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def owned_by(name: str, count: int) -> list[Visit]:
    """``count`` visits of users whose first choice is instance ``name`` (of two)."""
    plan = [v for v in visits(seed=7, count=60)
            if rendezvous_order(v.user_id, ["rank-0", "rank-1"])[0] == name]
    assert len(plan) >= count
    return plan[:count]


def system_on_a_clock() -> tuple[RelaySystem, Clock]:
    model = make_model(0, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    system = RelaySystem(config("relay"), model, store, flops_cost_model(model.cfg))
    clock = Clock()
    system.fleet.clock = clock
    return system, clock


def health(system: RelaySystem) -> dict[str, bool]:
    """What the router sees of each instance now."""
    return {v.instance_id: v.healthy for v in system.fleet.views()}


def test_a_failing_instance_is_answered_around_taken_out_and_probed_back() -> None:
    plan = owned_by("rank-1", 6)
    want, _ = serve("baseline", plan)
    system, clock = system_on_a_clock()
    _, victim = ranking_instances(system)

    async def main() -> list[Recommendation]:
        await system.start()
        try:
            passes = failing_passes(victim, DEVICE_ERROR)
            out = []
            for i, visit in enumerate(plan[:3]):      # three errors in a row: the breaker opens
                assert health(system) == {"rank-0": True, "rank-1": True}
                out.append(await system.recommend(visit))
                assert system.counters.instance_errors == system.counters.failovers == i + 1
            assert health(system) == {"rank-0": True, "rank-1": False}
            snap = system.fleet.snapshots()[1]
            assert not snap.healthy and snap.unhealthy_reason == (
                "circuit breaker open: 3 ranking calls in a row raised (the last: RuntimeError: "
                "CUDA error: an illegal memory access was encountered (injected))")
            out.append(await system.recommend(plan[3]))      # routed around, both legs
            assert out[-1].preinfer_instance == "rank-0"
            assert system.counters.instance_errors == 3

            clock.now_s += COOL_DOWN_S                       # half-open: the next leg probes
            assert health(system) == {"rank-0": True, "rank-1": True}
            out.append(await system.recommend(plan[4]))      # the probe raises: open again
            assert system.counters.instance_errors == 4
            assert health(system) == {"rank-0": True, "rank-1": False}

            clock.now_s += COOL_DOWN_S
            passes.error = None                              # the fault cleared
            out.append(await system.recommend(plan[5]))      # the probe answers: closed
            assert health(system) == {"rank-0": True, "rank-1": True}
            assert all(s.healthy and s.unhealthy_reason is None
                       for s in system.fleet.snapshots())
            # and the benchmark's counters of the run say so
            counters = CascadeUnderTest(system, RunClock(), False).snapshot().counters
            assert counters["instance_errors"] == counters["failovers"] == 4
            await system.wait_idle()
            for inst in system.instances:
                await inst.check_integrity()                 # the failed passes pinned nothing
            return out
        finally:
            await system.stop()

    out = asyncio.run(main())
    assert [r.instance for r in out] == ["rank-0"] * 5 + ["rank-1"]
    for got, expected in zip(out, want, strict=True):
        assert torch.equal(got.candidates, expected.candidates)
        torch.testing.assert_close(got.scores, expected.scores, atol=SCORE_TOL, rtol=SCORE_TOL)
    assert system.counters.failovers == 4 and system.fleet.breaker_opens == 2


def test_a_requests_own_error_is_not_failed_over_nor_held_against_the_instance() -> None:
    plan = owned_by("rank-1", 5)
    system, _ = system_on_a_clock()
    _, victim = ranking_instances(system)

    async def main() -> Recommendation:
        await system.start()
        try:
            passes = failing_passes(victim, SequenceTooLongError("prefix + suffix past "
                                                                 "max_seq_len (injected)"))
            for visit in plan[:4]:
                with pytest.raises(SequenceTooLongError, match="injected"):
                    await system.recommend(visit)
            assert health(system) == {"rank-0": True, "rank-1": True}
            assert system.fleet.breakers["rank-1"].errors == 0
            passes.error = None
            return await system.recommend(plan[4])
        finally:
            await system.stop()

    assert asyncio.run(main()).instance == "rank-1"
    assert system.counters.failovers == system.counters.instance_errors == 0


def test_the_breakers_never_take_the_whole_fleet_out() -> None:
    """With every instance raising, every request fails (503) and every breaker opens; the
    router still sees the instances that are up, so once the fault clears they answer at
    once, while health reports them out until each proves itself with a probe."""
    plan = owned_by("rank-1", 5)
    want, _ = serve("baseline", plan[3:4])
    system, clock = system_on_a_clock()

    async def main() -> list[Recommendation]:
        await system.start()
        try:
            faults = [failing_passes(inst, DEVICE_ERROR) for inst in ranking_instances(system)]
            for visit in plan[:3]:
                with pytest.raises(NoHealthyInstanceError):
                    await system.recommend(visit)
            assert all(not s.healthy for s in system.fleet.snapshots())
            assert health(system) == {"rank-0": True, "rank-1": True}
            for fault in faults:
                fault.error = None
            answered = await system.recommend(plan[3])
            assert all(not s.healthy for s in system.fleet.snapshots())   # no probe yet
            clock.now_s += COOL_DOWN_S
            probe = await system.recommend(plan[4])           # rank-1's probe: it is back
            assert [s.healthy for s in system.fleet.snapshots()] == [False, True]
            return [answered, probe]
        finally:
            await system.stop()

    answered, probe = asyncio.run(main())
    assert answered.instance == probe.instance == "rank-1"
    torch.testing.assert_close(answered.scores, want[0].scores, atol=SCORE_TOL, rtol=SCORE_TOL)
    assert system.counters.instance_errors == 6 and system.fleet.breaker_opens == 2


def test_a_half_open_instance_is_probed_by_the_request_whose_first_leg_reserved_it() -> None:
    """At the end of the cool-down, four of rank-1's users arrive at once. The first one's
    pre-infer goes to rank-1 and reserves the probe, so its ranking leg follows it there and
    closes the breaker; the others pre-infer on their next choice, and their ranking legs follow
    them there. No ranking leg is moved off the prefix it pre-inferred (none recomputes it),
    nothing counts as a failover, and every score is the full pass's."""
    plan, seen = [], set()
    for visit in owned_by("rank-1", 20):
        if visit.user_id not in seen:
            plan.append(visit)
            seen.add(visit.user_id)
    plan = plan[:4]
    assert len(plan) == 4
    want, _ = serve("baseline", plan)
    system, clock = system_on_a_clock()

    async def main() -> list[Recommendation]:
        await system.start()
        try:
            breaker = system.fleet.breakers["rank-1"]
            for _ in range(3):                                 # three errors: open at 0
                breaker.raised(breaker.send(0.0), 0.0, DEVICE_ERROR)
            clock.now_s = COOL_DOWN_S                          # half-open, no probe out
            assert health(system) == {"rank-0": True, "rank-1": True}
            out = await asyncio.gather(*(system.recommend(v) for v in plan))
            await system.wait_idle()
            return list(out)
        finally:
            await system.stop()

    out = asyncio.run(main())
    assert [r.preinfer_instance for r in out] == ["rank-1"] + ["rank-0"] * 3
    assert [r.instance for r in out] == [r.preinfer_instance for r in out]
    assert all(r.path is not RankPath.FULL for r in out), [r.path for r in out]
    assert system.fleet.breakers["rank-1"].state(clock.now_s) is BreakerState.CLOSED
    assert system.counters.failovers == system.counters.lost_preinfer == 0
    for got, expected in zip(out, want, strict=True):
        assert torch.equal(got.candidates, expected.candidates)
        torch.testing.assert_close(got.scores, expected.scores, atol=SCORE_TOL, rtol=SCORE_TOL)


def test_a_prefill_alone_reserves_the_probe_for_its_rank_and_lapses_without_it() -> None:
    """``/v1/prefill`` then ``/v1/rank`` are one request: a prefill routed to a half-open
    instance reserves its probe for the rank that follows it (another user's visit meanwhile
    goes to its next choice), and that rank closes the breaker from the relayed prefix. A
    prefill whose rank never comes holds the probe only for the pre-infer's lease."""
    users = sorted({v.user_id for v in owned_by("rank-1", 20)})
    assert len(users) >= 3
    candidates = torch.arange(1, 25)
    want = baseline_ranks([(users[0], candidates)])
    system, clock = system_on_a_clock()
    lease_s = system.config.instance.lease_s

    async def main() -> tuple[Recommendation, str, str]:
        await system.start()
        try:
            breaker = system.fleet.breakers["rank-1"]
            for _ in range(3):
                breaker.raised(breaker.send(0.0), 0.0, DEVICE_ERROR)
            clock.now_s = COOL_DOWN_S
            first, _ = await system.prefill(users[0])
            other, _ = await system.prefill(users[1])         # its rank never comes
            ranked = await system.rank_candidates(Visit(users[0]), candidates)
            assert breaker.state(clock.now_s) is BreakerState.CLOSED
            # open again; the next half-open probe is reserved by a prefill that never ranks
            for _ in range(3):
                breaker.raised(breaker.send(clock.now_s), clock.now_s, DEVICE_ERROR)
            clock.now_s += COOL_DOWN_S
            assert (await system.prefill(users[1]))[0] == "rank-1"
            assert (await system.prefill(users[2]))[0] == "rank-0"     # reserved
            clock.now_s += lease_s                                     # the reservation lapses
            assert (await system.prefill(users[2]))[0] == "rank-1"
            await system.wait_idle()
            return ranked, first, other
        finally:
            await system.stop()

    ranked, first, other = asyncio.run(main())
    assert (first, other) == ("rank-1", "rank-0")
    assert ranked.instance == "rank-1" and ranked.path is not RankPath.FULL
    assert system.counters.failovers == system.counters.lost_preinfer == 0
    assert torch.equal(ranked.candidates, want[0].candidates)
    torch.testing.assert_close(ranked.scores, want[0].scores, atol=SCORE_TOL, rtol=SCORE_TOL)


def baseline_ranks(requests: list[tuple[int, torch.Tensor]]) -> list[Recommendation]:
    """The full pass's ranking of each (user, candidates), in order, by the baseline."""
    model = make_model(0, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    system = RelaySystem(config("baseline"), model, store, flops_cost_model(model.cfg))

    async def main() -> list[Recommendation]:
        await system.start()
        try:
            return [await system.rank_candidates(Visit(u), c) for u, c in requests]
        finally:
            await system.stop()

    out = asyncio.run(main())
    assert all(r.path is RankPath.FULL for r in out)
    return out


@pytest.mark.parametrize("why", ["down", "breaker_open"])
def test_a_ranking_leg_moved_off_its_prefills_instance_counts_a_failover_and_a_lost_preinfer(
        why: str) -> None:
    """The instance a prefill went to is down, or out of routing (its breaker opened), when
    the rank comes: ``follow`` sends the rank to the user's next choice without an error. That
    is a failover (counted once) and the prefill's pre-infer did nothing (lost); the scores are
    the full pass's."""
    user = next(v.user_id for v in owned_by("rank-1", 1))
    candidates = torch.arange(1, 25)
    want = baseline_ranks([(user, candidates)])
    system, clock = system_on_a_clock()

    async def main() -> tuple[str, Recommendation]:
        await system.start()
        try:
            prefilled, _ = await system.prefill(user)
            if why == "down":
                await system.fail_instance(prefilled)
            else:
                breaker = system.fleet.breakers[prefilled]
                for _ in range(3):
                    breaker.raised(breaker.send(clock.now_s), clock.now_s, DEVICE_ERROR)
            ranked = await system.rank_candidates(Visit(user), candidates)
            await system.wait_idle()
            return prefilled, ranked
        finally:
            await system.stop()

    prefilled, ranked = asyncio.run(main())
    assert (prefilled, ranked.instance, ranked.path) == ("rank-1", "rank-0", RankPath.FULL)
    counters = system.counters
    assert (counters.failovers, counters.lost_preinfer, counters.instance_errors) == (1, 1, 0)
    assert torch.equal(ranked.candidates, want[0].candidates)
    torch.testing.assert_close(ranked.scores, want[0].scores, atol=SCORE_TOL, rtol=SCORE_TOL)
