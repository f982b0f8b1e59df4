"""A pre-inferred prefix is kept for the ranking leg that comes, and only while it can come.

Leases end on the pool's clock, set by hand here: nothing depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio

from relaygr.engine.instance import InstanceConfig, RankingInstance
from relaygr.engine.types import PreinferAction, RankJob, RankPath
from relaygr.kvcache import EntryState, KVLayout
from relaygr.relay.trigger import TriggerConfig, make_trigger
from tests.engine.helpers import flops_cost_model, spec_from_store
from tests.engine.test_instance import CANDIDATES, full_scores, idle, run, store_with
from tests.model.helpers import assert_close, make_model

MiB = 1 << 20


def _instance(pages: int, trigger: str, host_bytes: int = 0, reuse: bool = True,
              **model_cfg: int) -> RankingInstance:
    model = make_model(0, **model_cfg)
    page = KVLayout.for_model(model.cfg).page_bytes(16)
    trig = make_trigger(trigger, flops_cost_model(model.cfg),
                        TriggerConfig(max_pool_fraction=1.0) if trigger == "preinfer-all"
                        else TriggerConfig(), 1e-3)
    cfg = InstanceConfig(device_budget_bytes=pages * page, host_budget_bytes=host_bytes,
                         page_tokens=16, lease_s=2.0, cross_request_reuse=reuse)
    return RankingInstance("rank-0", "cpu", cfg, model, trig)


def test_leases_whose_ranking_never_came_stop_counting_once_over() -> None:
    """Two pre-infers whose ranking legs never came (shed, failed over) hold the footprint the
    trigger bounds only while leased: once the leases are over, the next user is pre-inferred.
    Without cache reuse nothing else reaches the pool's ``begin``, where leases used to end."""
    inst = _instance(40, "sequence-aware", reuse=False)
    store = store_with({1: 200, 2: 200, 3: 200})

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None
        now = [1000.0]
        res.pool.clock = lambda: now[0]
        for user in (1, 2):
            assert inst.preinfer(spec_from_store(store, user), 0, 40).action \
                is PreinferAction.PREFILL
        await idle(inst)
        held = res.pool.unevictable_bytes
        assert held > 0 and inst.preinfer(spec_from_store(store, 3), 0, 40).action \
            is PreinferAction.SKIPPED                   # leased: the footprint is full
        now[0] += 2.0                                   # both leases over
        assert inst.preinfer(spec_from_store(store, 3), 0, 40).action is PreinferAction.PREFILL
        await idle(inst)
        res.pool.check_integrity()

    run(scenario, inst)


def test_a_prefix_a_signal_finds_on_the_device_is_kept_for_its_ranking_leg() -> None:
    """The first leg finds the user's prefix IDLE (kept from a full pass) and leases it: another
    user's pre-infer admitted before the ranking leg comes evicts something else or nothing,
    and the ranking is a device hit, exact."""
    inst = _instance(26, "preinfer-all")              # two 200-token prefixes fit, not three
    store = store_with({1: 200, 2: 200, 3: 200})

    async def scenario(inst: RankingInstance) -> None:
        a, b, c = (spec_from_store(store, u) for u in (1, 2, 3))
        await inst.rank(RankJob(a, CANDIDATES))       # full passes: A, then B kept IDLE
        await inst.rank(RankJob(b, CANDIDATES))
        await idle(inst)
        res = inst.residency
        assert res is not None and res.resident(a.pid) is EntryState.IDLE   # and A is the LRU
        assert inst.preinfer(a, 0, 40).action is PreinferAction.ON_DEVICE
        assert res.resident(a.pid) is EntryState.READY
        assert inst.preinfer(c, 0, 40).action is PreinferAction.PREFILL   # evicts B, not A
        ranked = await inst.rank(RankJob(a, CANDIDATES))
        assert ranked.path is RankPath.DEVICE_HIT
        assert_close(ranked.scores, full_scores(inst.model, a))
        await idle(inst)
        res.pool.check_integrity()

    run(scenario, inst)


def test_a_ranking_requests_reload_extension_goes_before_pre_infers_nobody_waits_on() -> None:
    """A ranking request reloads its prefix from the host and extends it by its new events: that
    extension is on its critical path, so the scheduler runs it before a long pre-infer of
    another user queued earlier, as it would a pre-infer a request waits on."""
    inst = _instance(512, "sequence-aware", host_bytes=16 * MiB, query_block=16,
                     score_block_elems=16 * 64)
    store = store_with({1: 150, 2: 1500})

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None
        old = spec_from_store(store, 1)
        inst.preinfer(old, 0, 40)
        await inst.rank(RankJob(old, CANDIDATES))
        await idle(inst)                              # user 1's prefix demoted to the host
        assert res.pool.discard(old.pid)              # and only the host holds it
        store.append(1, [11, 12, 13, 14, 15])
        new = spec_from_store(store, 1)
        long = spec_from_store(store, 2)
        assert inst.preinfer(long, 0, 40).action is PreinferAction.PREFILL   # many rounds
        await asyncio.sleep(0)
        ranked = await inst.rank(RankJob(new, CANDIDATES))
        assert ranked.path is RankPath.HOST_HIT
        assert_close(ranked.scores, full_scores(inst.model, new))
        assert res.resident(long.pid) is EntryState.PENDING    # still going: it went second
        await idle(inst)

    run(scenario, inst)


def test_a_snapshot_counts_only_live_leases() -> None:
    """/metrics and /readyz read snapshots: a lease past its deadline no longer counts as
    unevictable there, whether or not a pre-infer signal came since."""
    inst = _instance(40, "sequence-aware")
    store = store_with({1: 200})

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None
        now = [1000.0]
        res.pool.clock = lambda: now[0]
        assert inst.preinfer(spec_from_store(store, 1), 0, 40).action is PreinferAction.PREFILL
        await idle(inst)
        leased = inst.snapshot().device
        assert leased is not None and leased.unevictable_bytes > 0
        now[0] += 2.0                                   # the lease is over, nothing else ran
        over = inst.snapshot().device
        assert over is not None and over.unevictable_bytes == 0
        assert over.used_bytes == leased.used_bytes     # kept, evictable now

    run(scenario, inst)


def test_a_lease_granted_while_the_entry_is_pinned_outlives_that_pin() -> None:
    """A request's second pre-infer signal (the same prefix: a visit with no new events) finds
    the entry still pinned by the previous ranking, whose demotion to the host is copying. The
    new lease is the new ranking leg's: the demotion's unpin must not end it, so another user's
    pre-infer evicts an idle entry, not this one, and the leg is a device hit, exact."""
    inst = _instance(26, "preinfer-all", host_bytes=16 * MiB)   # two 200-token prefixes fit
    store = store_with({1: 200, 2: 200, 3: 200})

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None
        a, b, c = (spec_from_store(store, u) for u in (1, 2, 3))
        for spec in (a, b):
            assert inst.preinfer(spec, 0, 40).action is PreinferAction.PREFILL
        await idle(inst)
        assert (await inst.rank(RankJob(a, CANDIDATES))).path is RankPath.DEVICE_HIT
        # A is still pinned: its demotion (spawned by the ranking) has not run yet
        held = res.pool.lookup(1)
        assert held is not None and held.pins == 1
        assert inst.preinfer(a, 0, 40).action is PreinferAction.ON_DEVICE       # leased again
        assert (await inst.rank(RankJob(b, CANDIDATES))).path is RankPath.DEVICE_HIT
        await idle(inst)                                # both demoted and released, A first
        assert res.resident(a.pid) is EntryState.READY  # its second lease is live
        assert res.resident(b.pid) is EntryState.IDLE
        assert inst.preinfer(c, 0, 40).action is PreinferAction.PREFILL   # evicts B, not A
        assert res.resident(a.pid) is EntryState.READY and res.resident(b.pid) is None
        ranked = await inst.rank(RankJob(a, CANDIDATES))
        assert ranked.path is RankPath.DEVICE_HIT
        assert_close(ranked.scores, full_scores(inst.model, a))
        await idle(inst)
        assert res.resident(a.pid) is EntryState.IDLE   # that leg consumed it
        res.pool.check_integrity()

    run(scenario, inst)
