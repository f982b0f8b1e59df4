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
from relaygr.cascade.proposals import EmbeddingRetrieval
from relaygr.cascade.stages import CandidateBook, EarlierStages
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.engine.instance import InstanceConfig, RankingInstance
from relaygr.engine.types import PreinferAction, RankPath
from relaygr.errors import CacheStateError, ConfigError, NoCandidatesError
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


def test_the_candidate_book_replays_exact_histories_and_misses_fall_back_to_live() -> None:
    model = make_model(0, num_items=NUM_ITEMS)
    stages = EarlierStages(EmbeddingRetrieval.of(model, 16, recency=1.0), 64, 0.0, 0.0)
    history = np.arange(1, 40, dtype=np.int64)
    marker = torch.tensor([7, 8, 9])             # not what retrieval would return
    book = CandidateBook()
    book.add(3, history, 24, marker, torch.tensor([3.0, 2.0, 1.0]))
    stages.book = book

    async def main() -> list[torch.Tensor]:
        return [(await stages.run(history, 24, user_id=3)).candidates,   # replayed
                (await stages.run(history, 24, user_id=4)).candidates,   # another user: live
                (await stages.run(history[:-1], 24, user_id=3)).candidates,  # another history
                (await stages.run(history, 12, user_id=3)).candidates]   # another count: live

    try:
        replayed, other_user, other_history, fewer = asyncio.run(main())
    finally:
        stages.shutdown()
    assert replayed is marker
    assert torch.equal(other_user, stages.candidates(history, 24)[0])
    assert torch.equal(other_history, stages.candidates(history[:-1], 24)[0])
    assert torch.equal(fewer, stages.candidates(history, 12)[0])
    assert (stages.replayed, stages.retrieved, len(book)) == (1, 3, 1)


def test_stage_scores_follow_the_kept_candidates_live_and_replayed() -> None:
    model = make_model(0, num_items=NUM_ITEMS)
    retrieval = EmbeddingRetrieval.of(model, 16, recency=1.0)
    history = np.arange(1, 40, dtype=np.int64)
    ids, scores = retrieval.scored(history, 64)
    assert np.array_equal(ids, retrieval.propose(history, 64))
    assert (np.diff(scores) <= 0).all()                       # best first
    fresh = ~np.isin(ids, history)                            # pre-processing's filter
    stages = EarlierStages(retrieval, 64, 0.0, 0.0)
    kept, kept_scores = stages.candidates(history, 24)
    assert torch.equal(kept, torch.from_numpy(ids[fresh][:24]))
    assert torch.equal(kept_scores, torch.from_numpy(scores[fresh][:24]))
    book = CandidateBook()
    book.add(4, history, 24, torch.tensor([7, 8]), torch.tensor([2.0, 1.0]))
    stages.book = book

    async def main() -> list[torch.Tensor]:
        live = await stages.run(history, 24, user_id=3)     # not in the book: live
        replayed = await stages.run(history, 24, user_id=4)
        return [live.candidates, live.scores, replayed.candidates, replayed.scores]

    try:
        live_ids, live_scores, replayed_ids, replayed_scores = asyncio.run(main())
    finally:
        stages.shutdown()
    assert torch.equal(live_ids, kept) and torch.equal(live_scores, kept_scores)
    assert replayed_ids.tolist() == [7, 8] and replayed_scores.tolist() == [2.0, 1.0]
    assert (stages.replayed, stages.retrieved) == (1, 1)


def test_retrieval_k_beyond_the_catalogue_retrieves_all_of_it() -> None:
    model = make_model(0, num_items=NUM_ITEMS)
    stages = EarlierStages(EmbeddingRetrieval.of(model, 16, recency=1.0), 4 * NUM_ITEMS, 0.0, 0.0)
    try:
        history = np.arange(1, 40, dtype=np.int64)
        every = stages.candidates(history, NUM_ITEMS)[0]       # all items not in the history
        assert sorted(every.tolist()) == list(range(40, NUM_ITEMS + 1))
        assert torch.equal(stages.candidates(history, 16)[0], every[:16])
    finally:
        stages.shutdown()


def test_a_history_that_covers_the_proposals_still_gets_a_full_list_of_unseen_items() -> None:
    """The user has already seen what retrieval proposes first (a long history): retrieval is
    asked again without the seen items, so the request still ranks ``num_candidates`` unseen
    items, the best ones by the same user vector."""
    model = make_model(0, num_items=NUM_ITEMS)
    retrieval = EmbeddingRetrieval.of(model, 8, recency=1.0)
    stages = EarlierStages(retrieval, 32, 0.0, 0.0)
    try:
        latest = np.arange(1, 9, dtype=np.int64)
        first = retrieval.scored(latest, 32)[0]
        # seen before the latest 8 events, which alone make the user vector: the same vector
        history = np.concatenate([np.setdiff1d(first, latest), latest])
        assert not (~np.isin(first, history)).any()        # every first proposal is seen
        kept = stages.candidates(history, 16)[0].numpy()
        assert len(kept) == 16 and not np.isin(kept, history).any()
        assert stages.refilled == 1
        best_unseen = retrieval.scored(history, 32, exclude=history)[0][:16]
        np.testing.assert_array_equal(kept, best_unseen)
    finally:
        stages.shutdown()


def test_a_user_who_has_seen_every_item_gets_a_typed_error_before_ranking() -> None:
    model = make_model(0, num_items=NUM_ITEMS)
    stages = EarlierStages(EmbeddingRetrieval.of(model, 8, recency=1.0), 32, 0.0, 0.0)
    try:
        everything = np.arange(1, NUM_ITEMS + 1, dtype=np.int64)
        with pytest.raises(NoCandidatesError, match="no item this user has not seen"):
            stages.candidates(everything, 16)
        # one unseen item left: a list of one
        assert stages.candidates(everything[1:], 16)[0].tolist() == [1]
    finally:
        stages.shutdown()


def test_a_booked_system_ranks_what_a_live_one_ranks() -> None:
    visit_list = visits(count=12)
    live, _ = serve("relay", visit_list)
    model = make_model(0, num_items=NUM_ITEMS)
    live_stages = config("relay").stages      # the booked candidates come from the same stage
    stages = EarlierStages(EmbeddingRetrieval.of(model, live_stages.retrieval_history,
                                                 recency=live_stages.retrieval_recency),
                           live_stages.retrieval_k, 0.0, 0.0)
    book = CandidateBook()
    grown = {u: items for u, (items, _) in histories().items()}
    for v in visit_list:   # the visits run one at a time: each sees the previous one's events
        assert v.num_candidates is not None
        seen = np.concatenate([grown[v.user_id], np.asarray(v.recent_items, dtype=np.int64)])
        book.add(v.user_id, seen, v.num_candidates,
                 *stages.candidates(seen, v.num_candidates))
        grown[v.user_id] = seen
    stages.shutdown()
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    system = RelaySystem(config("relay"), model, store, flops_cost_model(model.cfg), book=book)

    async def main() -> list[Recommendation]:
        await system.start()
        try:
            return [await system.recommend(v) for v in visit_list]
        finally:
            await system.stop()

    booked = asyncio.run(main())
    assert (system.stages.replayed, system.stages.retrieved) == (len(visit_list), 0)
    for a, b in zip(live, booked, strict=True):
        assert torch.equal(a.candidates, b.candidates)
        torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=1e-5)


def test_a_hash_collision_in_the_book_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    from relaygr.cascade import stages as stages_module
    monkeypatch.setattr(stages_module, "hash", lambda _: 0, raising=False)   # every key collides
    book = CandidateBook()
    first, second = np.arange(1, 10), np.arange(2, 11)
    book.add(5, first, 8, torch.tensor([1]), torch.tensor([1.0]))
    book.add(5, second, 8, torch.tensor([2]), torch.tensor([2.0]))   # same hash: takes the slot
    assert book.get(5, first, 8) is None           # never the other history's candidates
    found = book.get(5, second, 8)
    assert found is not None and torch.equal(found[0], torch.tensor([2]))


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
