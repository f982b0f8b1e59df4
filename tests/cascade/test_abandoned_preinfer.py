"""A pre-infer whose ranking leg will not come to its instance (failed over, shed) is abandoned
there: a job not started is cancelled and its entry freed at once, so it holds no footprint the
trigger bounds and takes no compute; one complete loses its lease (IDLE, evictable)."""

from __future__ import annotations

import asyncio

import torch

from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation
from relaygr.engine.instance import RankingInstance
from relaygr.engine.types import PreinferAction, RankJob, RankPath, RankResult
from relaygr.kvcache import EntryState
from tests.cascade.test_instance_errors import DEVICE_ERROR, owned_by
from tests.cascade.test_system import NUM_ITEMS, config, histories, ranking_instances, serve
from tests.engine.helpers import flops_cost_model, spec_from_store
from tests.engine.test_instance import CANDIDATES, full_scores, idle, run, store_with
from tests.engine.test_leases import MiB, _instance
from tests.model.helpers import make_model
from tests.tolerance import SCORE_TOL


def held_prefills(instance: RankingInstance) -> asyncio.Event:
    """Keep ``instance``'s pre-infer jobs queued (as ranking work would, which goes first)
    until the returned gate is set."""
    sched = instance.scheduler
    original = sched._run_prefill_round
    gate = asyncio.Event()

    async def held() -> None:
        await gate.wait()
        if sched.prefill_queue_depth:
            await original()
    sched._run_prefill_round = held      # type: ignore[method-assign]
    return gate


def first_prefill_round_then_held(instance: RankingInstance
                                  ) -> tuple[asyncio.Event, asyncio.Event]:
    """Let ``instance`` run one pre-infer round, then hold the rest until the second returned
    gate is set; the first is set once that round is done (a job started, not finished,
    however fast the machine)."""
    sched = instance.scheduler
    original = sched._run_prefill_round
    first, gate = asyncio.Event(), asyncio.Event()

    async def one_then_held() -> None:
        if first.is_set():
            await gate.wait()
        if sched.prefill_queue_depth:
            await original()
            first.set()
    sched._run_prefill_round = one_then_held      # type: ignore[method-assign]
    return first, gate


def test_a_failed_over_legs_queued_preinfer_is_cancelled_and_its_entry_freed() -> None:
    """The owner raises at ranking: the leg fails over and is answered elsewhere with the full
    pass's scores, and the pre-infer it left queued on the owner is cancelled at once: no
    PENDING entry, no footprint, no job left to compute."""
    plan = owned_by("rank-1", 1)
    want, _ = serve("baseline", plan)
    model = make_model(0, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    system = RelaySystem(config("relay"), model, store, flops_cost_model(model.cfg))
    _, owner = ranking_instances(system)

    async def raising(job: RankJob) -> RankResult:
        raise DEVICE_ERROR

    async def main() -> Recommendation:
        await system.start()
        gate = held_prefills(owner)
        owner.rank = raising                 # type: ignore[method-assign]
        try:
            rec = await system.recommend(plan[0])
            res = owner.residency
            assert res is not None
            assert res.pool.lookup(plan[0].user_id) is None       # the entry is freed
            assert res.pool.unevictable_bytes == 0
            assert owner.scheduler.prefill_queue_depth == 0       # nothing left to compute
            assert res.counters.preinfers_cancelled == 1
            res.pool.check_integrity()
            return rec
        finally:
            gate.set()
            await system.wait_idle()
            await system.stop()

    rec = asyncio.run(main())
    assert rec.preinfer_instance == "rank-1" and rec.instance == "rank-0"
    assert rec.path is RankPath.FULL
    assert system.counters.failovers == system.counters.lost_preinfer == 1
    assert torch.equal(rec.candidates, want[0].candidates)
    torch.testing.assert_close(rec.scores, want[0].scores, atol=SCORE_TOL, rtol=SCORE_TOL)


def test_a_complete_abandoned_preinfer_loses_its_lease_and_stays_a_hit() -> None:
    """On the instance: a complete pre-infer whose leg will not come is IDLE at once (evictable,
    no footprint), still a device hit for a ranking that does come (a retry)."""
    model = make_model(0, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    system = RelaySystem(config("relay"), model, store, flops_cost_model(model.cfg))
    inst, _ = ranking_instances(system)
    spec = system.path._prefix_spec(3, 0)[0]

    async def main() -> None:
        await system.start()
        try:
            res = inst.residency
            assert res is not None
            assert inst.preinfer(spec, 0, 24).action is PreinferAction.PREFILL
            await inst.idle()
            assert res.resident(spec.pid) is EntryState.READY
            assert inst.abandon(spec.pid)
            assert res.resident(spec.pid) is EntryState.IDLE
            assert res.pool.unevictable_bytes == 0
            assert res.counters.preinfers_unleased == 1
            ranked = await inst.rank(RankJob(spec, torch.arange(1, 25)))   # still a hit
            assert ranked.path is RankPath.DEVICE_HIT
            full = model.rank(torch.arange(1, 25), prefix_items=spec.items,
                              prefix_timestamps=spec.timestamps)
            torch.testing.assert_close(ranked.scores, full, atol=SCORE_TOL, rtol=SCORE_TOL)
            await inst.idle()
            res.pool.check_integrity()
        finally:
            await system.stop()

    asyncio.run(main())


def test_a_started_abandoned_preinfer_finishes_unleased() -> None:
    """A job with rounds done is not cancelled (they are spent): it finishes and commits IDLE,
    evictable, no footprint, and serves a ranking that does come (a retry) from the device."""
    inst = _instance(512, "sequence-aware", host_bytes=16 * MiB, query_block=16,
                     score_block_elems=16 * 64)
    spec = spec_from_store(store_with({2: 1500}), 2)

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None
        first, gate = first_prefill_round_then_held(inst)
        assert inst.preinfer(spec, 0, 40).action is PreinferAction.PREFILL
        work = res._inflight[2]
        await first.wait()
        assert work.rounds > 0 and not work.future.done()     # started, many rounds to go
        assert inst.abandon(spec.pid) and res.counters.preinfers_unleased == 1
        assert res.resident(spec.pid) is EntryState.PENDING
        gate.set()
        await idle(inst)
        assert res.resident(spec.pid) is EntryState.IDLE
        assert res.pool.unevictable_bytes == 0 and res.counters.preinfers_cancelled == 0
        ranked = await inst.rank(RankJob(spec, CANDIDATES))
        assert ranked.path is RankPath.DEVICE_HIT
        torch.testing.assert_close(ranked.scores, full_scores(inst.model, spec),
                                   atol=SCORE_TOL, rtol=SCORE_TOL)
        await idle(inst)
        res.pool.check_integrity()

    run(scenario, inst)
