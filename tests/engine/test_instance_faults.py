"""One ranking instance when something goes wrong: malformed input refused before anything is
reserved, and every cache fault (a pre-infer that cannot start or commit, a reload that fails, a
history store that cannot be reached) degraded to a full pass with the full pass's scores,
counted, leaving nothing pending or pinned."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
import torch

from relaygr.engine.instance import RankingInstance
from relaygr.engine.types import PrefixSpec, PreinferAction, RankJob, RankPath
from relaygr.errors import CacheStateError, HistoryStoreUnavailableError, InvalidInputError
from relaygr.kvcache import PrefixId
from relaygr.relay.trigger import TriggerConfig, make_trigger
from tests.engine.helpers import spec_from_store
from tests.engine.test_instance import (
    CANDIDATES,
    full_scores,
    idle,
    make_instance,
    run,
    store_with,
)
from tests.model.helpers import assert_close, make_model


def test_malformed_prefixes_and_jobs_are_refused_before_anything_is_reserved() -> None:
    """A prefix whose events do not fill the tokens it names would leave its entry PENDING;
    a grown name other than prefix + suffix would file the ranked K/V under other events."""
    store = store_with({1: 100})
    spec = spec_from_store(store, 1)
    with pytest.raises(InvalidInputError, match="101 tokens named, events of shape"):
        PrefixSpec(PrefixId(1, 101, spec.pid.version), spec.items, None, spec.version_at)
    with pytest.raises(InvalidInputError, match="timestamps of shape"):
        PrefixSpec(spec.pid, spec.items, torch.zeros(99, dtype=torch.int64), spec.version_at)
    suffix = torch.tensor([7, 8, 9])
    for grown in (PrefixId(1, 104, 5), PrefixId(2, 103, 5)):
        with pytest.raises(InvalidInputError, match="must be user 1 with 103 tokens"):
            RankJob(spec, CANDIDATES, suffix, grown=grown)
    with pytest.raises(InvalidInputError, match="suffix timestamps"):
        RankJob(spec, CANDIDATES, suffix, torch.zeros(2, dtype=torch.int64))
    assert RankJob(spec, CANDIDATES, suffix, grown=PrefixId(1, 103, 5)).suffix_tokens == 3


def test_cache_faults_degrade_to_a_full_pass_and_leave_nothing_pending() -> None:
    """A pre-infer whose entry cannot be committed is aborted (not left PENDING for the
    ranking to wait on), and a host copy whose check against the request's events raises
    (the history store unreachable) is not used: both rank in full, counted."""
    model = make_model(4)
    store = store_with({1: 100, 2: 90})

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None
        commit = res.pool.commit

        def failing_commit(*args: object, **kwargs: object) -> None:
            raise CacheStateError("commit failed (injected)")

        spec = spec_from_store(store, 1)
        res.pool.commit = failing_commit  # type: ignore[method-assign]
        try:
            assert inst.preinfer(spec, 0, 40).action is PreinferAction.PREFILL
            await idle(inst)
        finally:
            res.pool.commit = commit  # type: ignore[method-assign]
        assert res.resident(spec.pid) is None and res.pool.stats.pending == 0
        assert res.counters.prefills_failed == 1
        out = await asyncio.wait_for(inst.rank(RankJob(spec, CANDIDATES)), 60)
        assert out.path is RankPath.FULL
        assert_close(out.scores, full_scores(model, spec))

        other = spec_from_store(store, 2)
        await inst.rank(RankJob(other, CANDIDATES))      # a full pass: its K/V kept on both tiers
        await idle(inst)
        assert res.pool.discard(other.pid)                # the host copy stays

        def unreachable(n: int) -> int:
            raise HistoryStoreUnavailableError("store timeout (injected)")

        flaky = PrefixSpec(other.pid, other.items, None, unreachable)
        out = await inst.rank(RankJob(flaky, CANDIDATES))
        assert out.path is RankPath.FULL and res.counters.host_checks_failed == 1
        assert_close(out.scores, full_scores(model, other))

    run(scenario, make_instance(model))


def test_a_preinfer_that_cannot_start_reserves_nothing_and_ranking_computes_in_full() -> None:
    """A pre-infer job that raises while it is built (here: an injected failure, as an
    allocation of its tensors on the device could) leaves no PENDING entry behind for the
    ranking request to wait on: the signal reports it, ranking recomputes the prefix."""
    model = make_model(5)
    store = store_with({6: 120})
    spec = spec_from_store(store, 6)

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None

        def failing(requests: object) -> None:
            raise RuntimeError("out of memory (injected)")

        model.prefill_job = failing  # type: ignore[method-assign,assignment]
        try:
            pre = inst.preinfer(spec, 0, 40)
        finally:
            del model.prefill_job
        assert pre.action is PreinferAction.FAILED
        assert res.resident(spec.pid) is None and res.pool.stats.pending == 0
        assert res.counters.prefills_failed == 1
        out = await asyncio.wait_for(inst.rank(RankJob(spec, CANDIDATES)), 60)
        assert out.path is RankPath.FULL
        assert_close(out.scores, full_scores(model, spec))

    run(scenario, make_instance(model))


def test_a_preinfer_that_does_not_start_gives_its_tokens_back() -> None:
    """The trigger's load bound counts pre-infer compute that runs: an admitted pre-infer the
    pool refuses, or whose job cannot be built, takes nothing from it."""
    model = make_model(5)
    store = store_with({6: 120, 7: 130})

    async def scenario(inst: RankingInstance) -> None:
        res, trigger = inst.residency, inst.trigger
        assert res is not None and trigger is not None
        full = trigger.bucket.level_tokens
        with mock.patch.object(res, "start_prefill", return_value=False):    # the pool refuses
            assert inst.preinfer(spec_from_store(store, 6), 0, 40).action \
                is PreinferAction.REFUSED
        assert trigger.bucket.level_tokens == full
        with mock.patch.object(model, "prefill_job", side_effect=RuntimeError("out of memory")):
            assert inst.preinfer(spec_from_store(store, 7), 0, 40).action \
                is PreinferAction.FAILED
        assert trigger.bucket.level_tokens == full
        spec = spec_from_store(store, 6)
        assert inst.preinfer(spec, 0, 40).action is PreinferAction.PREFILL
        assert trigger.bucket.level_tokens == full - spec.num_tokens

    inst = make_instance(model)
    assert inst.trigger is not None       # a stopped clock: the bucket does not refill
    inst.trigger = make_trigger("sequence-aware", inst.trigger.cost_model, TriggerConfig(),
                                inst.trigger.slo_ms, clock=lambda: 0.0)
    run(scenario, inst)


def test_a_reload_that_fails_degrades_the_ranking_to_a_full_pass() -> None:
    """The host copy's extension fails (injected): the ranking request is answered by a full
    pass with the full pass's scores, the failure counted, no entry left pending or pinned."""
    model = make_model(3)
    store = store_with({4: 150})
    spec = spec_from_store(store, 4)

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None
        inst.preinfer(spec, 0, 40)
        await inst.rank(RankJob(spec, CANDIDATES))
        await idle(inst)                                  # demoted to the host tier
        store.append(4, [11, 12, 13, 14, 15])
        spec2 = spec_from_store(store, 4)

        async def failing(spec: PrefixSpec, start: int, past: object) -> None:
            raise RuntimeError("extension failed (injected)")

        res._extension = failing  # type: ignore[method-assign,assignment]
        assert inst.preinfer(spec2, 0, 40).action is PreinferAction.RELOAD
        out = await inst.rank(RankJob(spec2, CANDIDATES))
        assert out.path is RankPath.FULL
        assert_close(out.scores, full_scores(model, spec2))
        assert res.counters.reloads_failed >= 1
        await asyncio.gather(*res.background, return_exceptions=True)
        assert res.pool.stats.pending == 0 and res.pool.stats.in_use == 0

    run(scenario, make_instance(model))
