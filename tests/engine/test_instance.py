"""One ranking instance through the relay lifecycle, with exact paths, states and scores."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import torch

from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.engine.instance import InstanceConfig, RankingInstance
from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.types import PrefixSpec, PreinferAction, RankJob, RankPath
from relaygr.errors import (
    ConfigError,
)
from relaygr.kvcache import EntryState, PrefixId
from relaygr.model import HSTU
from relaygr.relay.trigger import TriggerConfig, TriggerReason, make_trigger
from tests.engine.helpers import flops_cost_model, spec_from_store
from tests.model.helpers import assert_close, make_model

MiB = 1 << 20
CANDIDATES = torch.arange(1, 41)


def make_instance(model: HSTU, *, slo_ms: float = 1e-3, host: bool = True,
                  trigger: str | None = "sequence-aware") -> RankingInstance:
    """An instance whose trigger finds every prefix at risk (tiny SLO) unless told otherwise."""
    cost = flops_cost_model(model.cfg)
    trig = None if trigger is None else make_trigger(trigger, cost, TriggerConfig(), slo_ms)
    return RankingInstance("rank-0", "cpu",
                           InstanceConfig(device_budget_bytes=4 * MiB,
                                          host_budget_bytes=16 * MiB if host else 0,
                                          page_tokens=16), model, trig)


def store_with(users: dict[int, int], seed: int = 0) -> InMemoryHistoryStore:
    gen = torch.Generator().manual_seed(seed)
    return InMemoryHistoryStore.from_sequences(
        {u: (torch.randint(1, 501, (n,), generator=gen).numpy(), None) for u, n in users.items()},
        num_items=500)


def full_scores(model: HSTU, spec: PrefixSpec, suffix: torch.Tensor | None = None
                ) -> torch.Tensor:
    return model.rank(CANDIDATES, prefix_items=spec.items, suffix_items=suffix)


def run(scenario: Callable[[RankingInstance], Awaitable[None]], instance: RankingInstance
        ) -> None:
    async def main() -> None:
        await instance.start()
        try:
            await scenario(instance)
        finally:
            await instance.stop()

    asyncio.run(main())


async def idle(instance: RankingInstance) -> None:
    """Let background work (pre-infer rounds, demotions) finish."""
    while instance.queue_depth or (instance.residency and instance.residency.background):
        if instance.residency and instance.residency.background:
            await asyncio.gather(*instance.residency.background)
        await asyncio.sleep(0.001)


def test_preinfer_then_rank_is_a_device_hit_with_exact_scores() -> None:
    model = make_model(0)
    store = store_with({1: 300})
    spec = spec_from_store(store, 1)

    async def scenario(inst: RankingInstance) -> None:
        result = inst.preinfer(spec, 0, len(CANDIDATES))
        assert (result.action, result.reason, result.tokens) == (
            PreinferAction.PREFILL, TriggerReason.ADMITTED, 300)
        assert inst.residency is not None
        assert inst.residency.resident(spec.pid) is EntryState.PENDING
        await idle(inst)
        assert inst.residency.resident(spec.pid) is EntryState.READY
        assert inst.preinfer(spec, 0, 40).action is PreinferAction.ON_DEVICE
        ranked = await inst.rank(RankJob(spec, CANDIDATES))
        assert ranked.path is RankPath.DEVICE_HIT
        assert_close(ranked.scores, full_scores(model, spec))
        await idle(inst)
        assert inst.residency.resident(spec.pid) is EntryState.IDLE     # lease consumed
        assert inst.residency.host is not None
        hit = inst.residency.host.lookup(1)
        assert hit is not None and hit.pid == spec.pid                  # demoted to host
        inst.residency.pool.check_integrity()
        inst.residency.host.check_integrity()

    run(scenario, make_instance(model))


def test_ranking_that_arrives_during_preinfer_waits_for_it() -> None:
    model = make_model(1, query_block=32)
    store = store_with({5: 400})
    spec = spec_from_store(store, 5)

    async def scenario(inst: RankingInstance) -> None:
        assert inst.preinfer(spec, 0, 40).action is PreinferAction.PREFILL
        ranked = await inst.rank(RankJob(spec, CANDIDATES))     # prefill still has rounds left
        assert ranked.path is RankPath.PENDING_WAIT
        assert_close(ranked.scores, full_scores(model, spec))
        assert inst.residency is not None and inst.residency.counters.waits == 1
        assert inst.scheduler.stats.prefill_jobs_done == 1       # it was not recomputed
        assert inst.paths == {"pending_wait": 1}
        # its time: the wait for the pre-infer shows as lookup, then its own batch
        t = ranked.timing
        assert t is not None and t.batch_size == 1 and t.transport_s == 0.0
        assert t.lookup_s > 0 and t.compute_s > 0 and t.queue_s >= 0
        assert t.lookup_s + t.queue_s + t.compute_s <= t.total_s

    run(scenario, make_instance(model))


def test_next_visit_reloads_prefix_plus_ranked_suffix_from_host() -> None:
    """The suffix K/V a ranking computed is demoted with the prefix: the returning user's new
    prefix (old prefix + last visit's events) is an exact host hit, with nothing to compute."""
    model = make_model(2)
    store = store_with({3: 200})
    spec = spec_from_store(store, 3)
    suffix = torch.tensor([7, 8, 9])

    async def scenario(inst: RankingInstance) -> None:
        grown = PrefixId(3, 203, store.version_after(3, 200, suffix.numpy()))
        inst.preinfer(spec, 3, 40)
        first = await inst.rank(RankJob(spec, CANDIDATES, suffix, grown=grown))
        assert first.path is RankPath.DEVICE_HIT or first.path is RankPath.PENDING_WAIT
        await idle(inst)
        store.append(3, suffix.numpy())
        spec2 = spec_from_store(store, 3)
        assert spec2.pid == grown
        rounds_before = inst.scheduler.stats.prefill_rounds
        pre = inst.preinfer(spec2, 0, 40)
        assert (pre.action, pre.reason, pre.tokens) == (
            PreinferAction.RELOAD, TriggerReason.HOST_HIT, 0)
        second = await inst.rank(RankJob(spec2, CANDIDATES))
        assert second.path is RankPath.HOST_HIT
        assert inst.scheduler.stats.prefill_rounds == rounds_before   # a copy, no compute
        assert_close(second.scores, full_scores(model, spec2))

    run(scenario, make_instance(model))


def test_a_reload_never_ranked_from_does_not_label_a_later_entry() -> None:
    """A reload whose ranking never came, its entry and host copy gone with time, and the
    prefix computed again by a full pass: ranking from that entry is a device hit, not a
    host hit (the path counts say where a prefix came from)."""
    model = make_model(2)
    store = store_with({3: 200})
    spec = spec_from_store(store, 3)

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None and res.host is not None
        now = [1000.0]
        res.pool.clock = res.host.clock = lambda: now[0]
        inst.preinfer(spec, 0, 40)
        await inst.rank(RankJob(spec, CANDIDATES))
        await idle(inst)
        assert res.pool.discard(spec.pid)                # the device copy goes; the host keeps one
        assert inst.preinfer(spec, 0, 40).action is PreinferAction.RELOAD
        await idle(inst)
        assert res.resident(spec.pid) is EntryState.READY      # reloaded, never ranked from
        now[0] += 1e6
        res.pool.expire_leases()
        assert res.host.expire() == 1 and res.pool.discard(spec.pid)
        again = await inst.rank(RankJob(spec, CANDIDATES))
        assert again.path is RankPath.FULL
        await idle(inst)
        assert res.resident(spec.pid) is EntryState.IDLE       # the full pass's K/V, kept
        last = await inst.rank(RankJob(spec, CANDIDATES))
        assert last.path is RankPath.DEVICE_HIT
        assert_close(last.scores, full_scores(model, spec))

    run(scenario, make_instance(model))


def test_host_copy_is_extended_with_only_the_new_events() -> None:
    model = make_model(3)
    store = store_with({4: 150})
    spec = spec_from_store(store, 4)

    async def scenario(inst: RankingInstance) -> None:
        inst.preinfer(spec, 0, 40)
        await inst.rank(RankJob(spec, CANDIDATES))
        await idle(inst)
        store.append(4, [11, 12, 13, 14, 15])            # events from elsewhere: prefix grows
        spec2 = spec_from_store(store, 4)
        assert inst.preinfer(spec2, 0, 40).tokens == 5   # extend 5 tokens, not 155
        second = await inst.rank(RankJob(spec2, CANDIDATES))
        assert second.path is RankPath.HOST_HIT
        assert_close(second.scores, full_scores(model, spec2))

    run(scenario, make_instance(model))


def test_stale_prefix_is_never_served_after_new_events() -> None:
    model = make_model(4)
    store = store_with({6: 120})
    spec = spec_from_store(store, 6)

    async def scenario(inst: RankingInstance) -> None:
        inst.preinfer(spec, 0, 40)
        await idle(inst)                                    # v1 READY on the device
        store.append(6, [42])
        spec2 = spec_from_store(store, 6)
        ranked = await inst.rank(RankJob(spec2, CANDIDATES))
        assert ranked.path is RankPath.FULL                 # v1 does not match v2
        assert_close(ranked.scores, full_scores(model, spec2))
        assert inst.residency is not None
        assert inst.residency.pool.stats.stale_misses >= 1

    run(scenario, make_instance(model, host=False))


def test_short_prefix_is_not_at_risk_and_miss_fills_the_cache() -> None:
    model = make_model(5)
    store = store_with({8: 40})
    spec = spec_from_store(store, 8)

    async def scenario(inst: RankingInstance) -> None:
        result = inst.preinfer(spec, 0, 40)
        assert (result.action, result.reason) == (PreinferAction.SKIPPED,
                                                  TriggerReason.NOT_AT_RISK)
        ranked = await inst.rank(RankJob(spec, CANDIDATES))
        assert ranked.path is RankPath.FULL
        await idle(inst)
        assert inst.residency is not None
        assert inst.residency.resident(spec.pid) is EntryState.IDLE    # filled at ranking time
        again = await inst.rank(RankJob(spec, CANDIDATES))
        assert again.path is RankPath.DEVICE_HIT
        assert_close(again.scores, ranked.scores)

    run(scenario, make_instance(model, slo_ms=1e9))


def test_failed_instance_rejects_work_and_restarts_empty() -> None:
    model = make_model(6)
    store = store_with({9: 100})
    spec = spec_from_store(store, 9)

    async def scenario(inst: RankingInstance) -> None:
        inst.preinfer(spec, 0, 40)
        await idle(inst)
        await inst.fail()
        assert not inst.healthy and inst.residency is None
        with pytest.raises(InstanceStoppedError):
            await inst.rank(RankJob(spec, CANDIDATES))
        assert inst.preinfer(spec, 0, 40).action is PreinferAction.SKIPPED
        await inst.restart()
        ranked = await inst.rank(RankJob(spec, CANDIDATES))
        assert ranked.path is RankPath.FULL                  # caches were lost
        assert_close(ranked.scores, full_scores(model, spec))

    run(scenario, make_instance(model))


def test_truncation_fallback_is_labelled() -> None:
    model = make_model(7)
    store = store_with({2: 90})
    spec = spec_from_store(store, 2)
    cost = flops_cost_model(model.cfg)
    inst = RankingInstance("rank-0", "cpu",
                           InstanceConfig(device_budget_bytes=0, truncate_to_tokens=32), model,
                           make_trigger("sequence-aware", cost, TriggerConfig(), slo_ms=1.0))

    async def scenario(inst: RankingInstance) -> None:
        ranked = await inst.rank(RankJob(spec, CANDIDATES))
        assert ranked.path is RankPath.TRUNCATED
        assert_close(ranked.scores, model.rank(CANDIDATES, prefix_items=spec.items[-32:]))

    run(scenario, inst)


def test_without_cross_request_reuse_a_prefix_serves_only_its_own_request() -> None:
    model = make_model(8)
    store = store_with({1: 200})
    spec = spec_from_store(store, 1)
    cost = flops_cost_model(model.cfg)
    inst = RankingInstance("rank-0", "cpu",
                           InstanceConfig(device_budget_bytes=4 * MiB,
                                          host_budget_bytes=16 * MiB, page_tokens=16,
                                          cross_request_reuse=False), model,
                           make_trigger("sequence-aware", cost, TriggerConfig(), slo_ms=1e-3))

    async def scenario(inst: RankingInstance) -> None:
        assert inst.residency is not None and inst.residency.host is None
        inst.preinfer(spec, 0, 40)
        first = await inst.rank(RankJob(spec, CANDIDATES))
        assert first.path in (RankPath.DEVICE_HIT, RankPath.PENDING_WAIT)
        await idle(inst)
        assert inst.residency.resident(spec.pid) is None          # freed after its ranking
        again = await inst.rank(RankJob(spec, CANDIDATES))        # no pre-infer this time
        assert again.path is RankPath.FULL
        await idle(inst)
        assert inst.residency.resident(spec.pid) is None          # and no fill at ranking
        assert_close(again.scores, first.scores)

    run(scenario, inst)


def test_short_cached_batches_on_the_loop_thread_score_as_on_the_worker() -> None:
    # An instance told to run short ranking batches on its loop's thread (as an instance
    # process does) gives the same scores, bit for bit, as one computing everything on its
    # worker, on the cached path and on a full pass (which stays on the worker).
    model = make_model(3)
    store = store_with({1: 300, 2: 200})
    cached, missed = spec_from_store(store, 1), spec_from_store(store, 2)

    def serve(on_loop: bool) -> tuple[list[torch.Tensor], dict[str, float]]:
        inst = make_instance(model)
        if on_loop:
            inst.rank_short_on_loop(1 << 21)
        out: list[torch.Tensor] = []

        async def scenario(inst: RankingInstance) -> None:
            inst.preinfer(cached, 0, len(CANDIDATES))
            await idle(inst)
            first = await inst.rank(RankJob(cached, CANDIDATES))
            full = await inst.rank(RankJob(missed, CANDIDATES))
            assert (first.path, full.path) == (RankPath.DEVICE_HIT, RankPath.FULL)
            out.extend([first.scores, full.scores])

        run(scenario, inst)
        return out, inst.snapshot().compute

    here, here_compute = serve(True)
    worker, worker_compute = serve(False)
    for a, b in zip(here, worker, strict=True):
        assert torch.equal(a, b)
    assert here_compute["rank_batches_on_loop"] == 1 and here_compute["rank_batches"] == 2
    assert worker_compute["rank_batches_on_loop"] == 0
    with pytest.raises(ConfigError):
        make_instance(model).rank_short_on_loop(-1)
