"""The whole cascade in every mode: same candidates, the baseline's scores, answers under faults."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from relaygr.cascade.config import StagesConfig, SystemConfig
from relaygr.cascade.instances import build_instance
from relaygr.cascade.modes import Mode
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.engine.instance import InstanceConfig, RankingInstance
from relaygr.engine.types import PreinferAction, RankPath
from relaygr.errors import CacheStateError, ConfigError
from relaygr.routing import rendezvous_order
from tests.engine.helpers import flops_cost_model
from tests.model.helpers import make_model
from tests.tolerance import SCORE_TOL

NUM_ITEMS = 500


def histories(seed: int = 0, users: int = 12) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for user in range(users):
        n = int(rng.integers(60, 500))
        ts = 1_600_000_000 + np.cumsum(rng.integers(1, 10_000, n))
        out[user] = (rng.integers(1, NUM_ITEMS + 1, n), ts)
    return out


def visits(seed: int = 1, count: int = 30) -> list[Visit]:
    rng = np.random.default_rng(seed)
    out, clock = [], 1_700_000_000
    for _ in range(count):
        clock += int(rng.integers(1, 100))
        recent = tuple(int(x) for x in rng.integers(1, NUM_ITEMS + 1, 3))
        out.append(Visit(int(rng.integers(0, 12)), recent, (clock - 2, clock - 1, clock), clock,
                         24))
    return out


def config(mode: str, **changes: object) -> SystemConfig:
    # A tiny SLO puts every prefix at risk, so the relay modes pre-infer.
    base = SystemConfig(mode=mode, slo_ms=0.01, num_instances=2,
                        stages=StagesConfig(retrieval_k=64, num_candidates=24,
                                            retrieval_delay_ms=1, preprocess_delay_ms=1),
                        instance=InstanceConfig(device_budget_bytes=8 << 20,
                                                host_budget_bytes=32 << 20, page_tokens=16))
    return base.with_(**changes)


def serve(mode: str, visit_list: list[Visit], **changes: object
          ) -> tuple[list[Recommendation], RelaySystem]:
    model = make_model(0, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    system = RelaySystem(config(mode, **changes), model, store, flops_cost_model(model.cfg))

    async def main() -> list[Recommendation]:
        await system.start()
        try:
            out = [await system.recommend(v) for v in visit_list]
            await system.wait_idle()
            return out
        finally:
            await system.stop()

    return asyncio.run(main()), system


def ranking_instances(system: RelaySystem) -> list[RankingInstance]:
    """The system's instances, built in this process (``build_instance``), typed."""
    out = []
    for inst in system.instances:
        assert isinstance(inst, RankingInstance)
        out.append(inst)
    return out


def test_every_mode_ranks_like_the_baseline() -> None:
    plan = visits()
    baseline, _ = serve("baseline", plan)
    assert {r.path for r in baseline} == {RankPath.FULL}
    for mode in Mode:
        out, system = serve(mode.value, plan)
        for got, want in zip(out, baseline, strict=True):
            assert torch.equal(got.candidates, want.candidates)
            torch.testing.assert_close(got.scores, want.scores, atol=SCORE_TOL,
                                       rtol=SCORE_TOL)
        if mode is not Mode.BASELINE:
            cached = sum(1 for r in out if r.path is not RankPath.FULL)
            assert cached > 0, f"{mode.value} never used its cache"
        for inst in ranking_instances(system):
            if inst.residency is not None:
                inst.residency.pool.check_integrity()
                if inst.residency.host is not None:
                    inst.residency.host.check_integrity()


def test_affinity_sends_both_legs_to_the_same_instance() -> None:
    out, system = serve("relay", visits(seed=3))
    for rec in out:
        assert rec.preinfer_instance == rec.instance
    ranked_by = {inst.name: sum(inst.paths.values()) for inst in ranking_instances(system)}
    assert all(count > 0 for count in ranked_by.values())      # users spread over both


def test_round_robin_ablation_splits_the_legs() -> None:
    out, _ = serve("relay-no-affinity", visits(seed=3))
    assert any(rec.preinfer_instance != rec.instance for rec in out)


def test_failed_instance_mid_run_loses_no_request() -> None:
    plan = visits(seed=4, count=24)
    baseline, _ = serve("baseline", plan)
    model = make_model(0, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    system = RelaySystem(config("relay"), model, store, flops_cost_model(model.cfg))

    async def main() -> list[Recommendation]:
        await system.start()
        try:
            out = []
            for i, v in enumerate(plan):
                if i == 8:
                    await system.fail_instance("rank-1")
                if i == 16:
                    await system.restart_instance("rank-1")
                out.append(await system.recommend(v))
            return out
        finally:
            await system.stop()

    out = asyncio.run(main())
    for got, want in zip(out, baseline, strict=True):
        torch.testing.assert_close(got.scores, want.scores, atol=SCORE_TOL, rtol=SCORE_TOL)
    assert all(r.instance == "rank-0" for r in out[8:16])        # its users moved
    assert system.counters.requests == len(plan)


def test_visit_appends_its_events_and_bad_config_is_rejected() -> None:
    plan = visits(count=1)
    _, system = serve("relay", plan)
    history = system.store.get(plan[0].user_id)
    assert tuple(int(x) for x in history.items[-3:]) == plan[0].recent_items
    with pytest.raises(ConfigError):
        SystemConfig(mode="relay-turbo")
    with pytest.raises(ConfigError):
        SystemConfig.from_dict({"instances": 2})


def test_instance_failing_under_in_flight_requests_still_answers_them() -> None:
    """Requests queued on an instance when it dies are answered elsewhere, correctly."""
    plan = visits(seed=6, count=16)
    baseline, _ = serve("baseline", plan)
    model = make_model(0, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    system = RelaySystem(config("relay", num_instances=2), model, store,
                         flops_cost_model(model.cfg))

    async def main() -> list[Recommendation]:
        await system.start()
        try:
            # distinct users, all at once: both instances get queued work
            first_visits: dict[int, Visit] = {}
            for v in plan:
                first_visits.setdefault(v.user_id, v)
            # compute held, so that work queues up on any machine, however fast
            release = threading.Event()
            holds = [asyncio.ensure_future(i.executor.run(release.wait))
                     for i in ranking_instances(system)]
            tasks = [asyncio.ensure_future(system.recommend(v)) for v in first_visits.values()]
            # every visit pre-infers (a tiny SLO) behind the held compute, and its ranking
            # request, once the earlier stages are done, waits on the victim for that prefix
            while not any(i.scheduler.prefill_waiters for i in ranking_instances(system)):
                await asyncio.sleep(0.001)
            victim = max(ranking_instances(system), key=lambda i: i.scheduler.prefill_waiters)
            failing = asyncio.ensure_future(system.fail_instance(victim.name))
            release.set()       # the stop waits for the compute in flight, then fails the rest
            await asyncio.gather(failing, *holds)
            return list(await asyncio.gather(*tasks))
        finally:
            await system.stop()

    out = asyncio.run(main())
    want: dict[int, Recommendation] = {}
    for v, rec in zip(plan, baseline, strict=True):
        want.setdefault(v.user_id, rec)
    assert len(out) == len(want)
    for rec, expected in zip(out, want.values(), strict=True):
        torch.testing.assert_close(rec.scores, expected.scores, atol=SCORE_TOL, rtol=SCORE_TOL)
    assert system.counters.failovers >= 1


@pytest.mark.parametrize("reported", ["at once", "later"])
def test_a_preinfer_that_raises_is_lost_and_the_visit_ranks_in_full_once(reported: str) -> None:
    """The pre-infer signal is advisory: an instance whose pre-infer raises (at once, as in
    this process, or in the awaited outcome, as an instance in another process reports it)
    loses the signal, counted; the visit is ranked in full with the baseline's scores and its
    events are appended once (an error after the append would make a retry append twice)."""
    model = make_model(0, num_items=NUM_ITEMS)

    def failing_preinfer(config: object, name: str, device: str, model: object,
                         cost_model: object) -> RankingInstance:
        instance = build_instance(config, name, device, model, cost_model)  # type: ignore[arg-type]

        def preinfer(spec: object, suffix_tokens: int, candidates: int) -> object:
            if reported == "at once":
                raise CacheStateError("host tier index inconsistent (injected)")

            async def outcome() -> None:
                raise CacheStateError("host tier index inconsistent (injected)")

            return asyncio.ensure_future(outcome())

        instance.preinfer = preinfer  # type: ignore[method-assign,assignment]
        return instance

    plan = visits(count=1)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    before = store.num_events(plan[0].user_id)
    system = RelaySystem(config("relay"), model, store, flops_cost_model(model.cfg),
                         instance_factory=failing_preinfer)

    async def main() -> Recommendation:
        await system.start()
        try:
            return await system.recommend(plan[0])
        finally:
            await system.stop()

    out = asyncio.run(main())
    assert out.path is RankPath.FULL and system.counters.lost_preinfer == 1
    assert store.num_events(plan[0].user_id) == before + 3
    reference, _ = serve("baseline", plan)
    torch.testing.assert_close(out.scores, reference[0].scores, atol=SCORE_TOL, rtol=SCORE_TOL)


def test_queued_preinfers_do_not_spill_the_owners_users() -> None:
    """The spill reads the ranking queue only: an owner with no ranking work but more queued
    pre-infer jobs than ``spill_queue_depth`` keeps its users, whose next visit reloads its host
    copy there instead of being pre-inferred again on their second choice."""
    model = make_model(0, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    system = RelaySystem(config("relay"), model, store, flops_cost_model(model.cfg))
    users = sorted(store)
    user = next(u for u in users if rendezvous_order(u, ["rank-0", "rank-1"])[0] == "rank-0")
    others = [u for u in users if u != user][:system.config.affinity.spill_queue_depth + 1]
    timestamps = store.get(user).timestamps
    assert timestamps is not None
    last = int(timestamps[-1])
    plan = [Visit(user, (1, 2, 3), (last + 1, last + 2, last + 3), last + 4, 24),
            Visit(user, (4, 5, 6), (last + 5, last + 6, last + 7), last + 8, 24)]
    want, _ = serve("baseline", plan)
    owner = system.by_name["rank-0"]
    assert isinstance(owner, RankingInstance)

    async def main() -> tuple[Recommendation, int, int]:
        await system.start()
        try:
            await system.recommend(plan[0])        # the owner's host tier keeps the prefix
            await system.wait_idle()
            for other in others:                   # other users' pre-infers queue on it
                spec, _ = system.path._prefix_spec(other, 0)
                owner.preinfer(spec, 0, 24)
            queued = (owner.rank_queue_depth, owner.scheduler.prefill_queue_depth)
            out = await system.recommend(plan[1])
            await system.wait_idle()
            return out, *queued
        finally:
            await system.stop()

    out, rank_queued, preinfers_queued = asyncio.run(main())
    assert rank_queued == 0 and preinfers_queued > system.config.affinity.spill_queue_depth
    assert out.preinfer_instance == out.instance == "rank-0"
    # the signal reloaded the host copy (no prefix recomputed); whether the copy was back on the
    # device before the ranking leg came (a device hit) or the leg finished it (a host hit) is
    # the machine's timing
    assert out.preinfer is not None and out.preinfer.action is PreinferAction.RELOAD
    assert out.path in (RankPath.HOST_HIT, RankPath.DEVICE_HIT)
    assert torch.equal(out.candidates, want[1].candidates)
    torch.testing.assert_close(out.scores, want[1].scores, atol=SCORE_TOL, rtol=SCORE_TOL)
