"""The one request path over a scripted fleet: what it sends, follows, counts and raises.

The path is the same object under the embedded system and the Ray ingress; these tests pin its
contract with the ``Fleet`` (``cascade.fleet``) so that either transport can be swapped in.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

import numpy as np
import pytest
import torch

from relaygr.cascade.config import OverloadConfig, SystemConfig
from relaygr.cascade.fleet import (
    SKIPPED,
    FirstLeg,
    InstanceFailed,
    InstanceLost,
    RankedLeg,
    rank_shed,
    sheds_preinfer,
)
from relaygr.cascade.proposals import EmbeddingRetrieval
from relaygr.cascade.request_path import RequestPath
from relaygr.cascade.stages import EarlierStages
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.visit import Visit
from relaygr.cascade.window import HistoryWindow
from relaygr.engine.types import (
    PrefixSpec,
    PreinferAction,
    PreinferResult,
    RankJob,
    RankPath,
    RankResult,
)
from relaygr.errors import NoHealthyInstanceError, OverloadedError, PreinferDisabledError
from relaygr.kvcache import PrefixId
from relaygr.routing import RouteDecision, RouteReason
from tests.cascade.test_system import NUM_ITEMS, config, histories
from tests.model.helpers import make_model
from tests.virtual_time import run_virtual

DONE = PreinferResult(PreinferAction.PREFILL, None, 7)


class ScriptedFleet:
    """A fleet whose rank answers are scripted per attempt: ``"lost"``, ``"raised"`` (the
    instance's own error), ``"shed"`` or a name (the instance that answers; a leg answered by
    another instance than the one it follows was moved: reason FAILOVER, as ``follow`` gives).
    ``deferred``: the first leg is answered later (as across Ray)."""

    def __init__(self, answers: list[str], deferred: bool = False, shed_first: bool = False
                 ) -> None:
        self.answers = list(answers)
        self.deferred = deferred
        self.shed_first = shed_first
        self.ranked: list[tuple[str, RouteDecision | None, tuple[str, ...]]] = []
        self.sent: list[tuple[str, bool]] = []
        self.abandoned: list[tuple[str, str | None]] = []     # (request, instance)

    @property
    def max_attempts(self) -> int:
        return 3

    def preinfer(self, request_id: str, user_id: int, spec: PrefixSpec, suffix_tokens: int,
                 candidates: int, send: bool) -> FirstLeg | Awaitable[FirstLeg]:
        self.sent.append((request_id, send))
        route = RouteDecision(user_id, "a", 0, False, RouteReason.OWNER)
        first = FirstLeg(route)
        if send:
            first = FirstLeg(route, "a", SKIPPED if self.shed_first else DONE,
                             shed=self.shed_first)
        if not self.deferred:
            return first

        async def later() -> FirstLeg:
            return first
        return asyncio.ensure_future(later())

    def abandon(self, request_id: str, first: FirstLeg, pid: PrefixId) -> None:
        self.abandoned.append((request_id, first.instance))

    async def rank(self, request_id: str, user_id: int, first: RouteDecision | None,
                   job: RankJob, avoid: tuple[str, ...]) -> RankedLeg:
        self.ranked.append((request_id, first, avoid))
        answer = self.answers.pop(0)
        lost = first.instance_id if first and not avoid else f"x{len(avoid)}"
        if answer == "lost":
            raise InstanceLost(lost)
        if answer == "raised":
            raise InstanceFailed(lost, RuntimeError("CUDA error (injected)"))
        if answer == "shed":
            depth_9 = SystemConfig(overload=OverloadConfig(max_rank_queue_depth=9))
            raise rank_shed(answer, 9, depth_9) or AssertionError
        reason = RouteReason.OWNER if first is None else RouteReason.FOLLOWED \
            if answer == first.instance_id else RouteReason.FAILOVER
        return RankedLeg(RankResult(torch.zeros(job.candidates.shape[0]), RankPath.FULL, answer),
                         RouteDecision(user_id, answer, 0, False, reason))


def make_path(fleet: ScriptedFleet, mode: str = "relay") -> RequestPath:
    model = make_model(0, num_items=NUM_ITEMS)
    store = InMemoryHistoryStore.from_sequences(histories(), num_items=NUM_ITEMS)
    cfg = config(mode)
    stages = EarlierStages(EmbeddingRetrieval.of(model, cfg.stages.retrieval_history,
                                                 recency=cfg.stages.retrieval_recency),
                           cfg.stages.retrieval_k, 0.0, 0.0)
    return RequestPath(fleet, cfg, store, HistoryWindow.for_model(model.cfg, cfg), stages)


VISIT = Visit(3, (5, 6), (1_700_000_001, 1_700_000_002), 1_700_000_003, 8)


@pytest.mark.parametrize("deferred", [False, True])
def test_both_legs_share_a_request_and_the_second_follows_the_first(deferred: bool) -> None:
    fleet = ScriptedFleet(["a"], deferred=deferred)
    path = make_path(fleet)
    before = path.store.num_events(3)
    rec = asyncio.run(path.recommend(VISIT))
    (rid, send), = fleet.sent
    assert send and fleet.ranked == [(rid, fleet.ranked[0][1], ())]
    assert fleet.ranked[0][1] is not None and fleet.ranked[0][1].instance_id == "a"
    assert rec.preinfer == DONE and rec.preinfer_instance == "a" and rec.instance == "a"
    assert path.store.num_events(3) == before + 2 and path.counters.requests == 1


def test_failover_avoids_each_lost_instance_then_gives_up() -> None:
    fleet = ScriptedFleet(["lost", "b"])
    path = make_path(fleet)
    assert asyncio.run(path.recommend(VISIT)).instance == "b"
    assert [avoid for _, _, avoid in fleet.ranked] == [(), ("a",)]
    assert path.counters.failovers == path.counters.lost_preinfer == 1

    fleet = ScriptedFleet(["lost"] * 3)
    path = make_path(fleet)
    with pytest.raises(NoHealthyInstanceError):
        asyncio.run(path.recommend(VISIT))
    assert path.counters.failovers == 3 and path.counters.requests == 0
    assert path.counters.instance_errors == 0


@pytest.mark.parametrize("deferred", [False, True])
def test_a_leg_moved_off_its_first_legs_instance_is_one_failover_and_its_preinfer_lost(
        deferred: bool) -> None:
    """``follow`` moves a ranking leg without an error when its first leg's instance is down or
    out of routing as it comes: one failover, and the pre-infer delivered there did nothing.
    After an error the move is that error's failover, not another one; a shed pre-infer was
    never delivered, and a leg that stayed lost nothing."""
    def counted(answers: list[str], shed_first: bool = False) -> tuple[int, int, int, int]:
        path = make_path(ScriptedFleet(answers, deferred=deferred, shed_first=shed_first))
        asyncio.run(path.recommend(VISIT))
        c = path.counters
        return c.failovers, c.instance_errors, c.lost_preinfer, c.shed_preinfer

    assert counted(["b"]) == (1, 0, 1, 0)
    assert counted(["raised", "b"]) == (1, 1, 1, 0)
    assert counted(["lost", "raised", "c"]) == (2, 1, 1, 0)
    assert counted(["b"], shed_first=True) == (1, 0, 0, 1)
    assert counted(["a"]) == (0, 0, 0, 0)


def test_an_instance_that_raised_is_failed_over_and_counted_apart() -> None:
    fleet = ScriptedFleet(["raised", "lost", "c"])
    path = make_path(fleet)
    assert asyncio.run(path.recommend(VISIT)).instance == "c"
    assert [avoid for _, _, avoid in fleet.ranked] == [(), ("a",), ("a", "x1")]
    assert path.counters.failovers == 2 and path.counters.instance_errors == 1

    fleet = ScriptedFleet(["raised"] * 3)
    path = make_path(fleet)
    with pytest.raises(NoHealthyInstanceError) as refused:
        asyncio.run(path.recommend(VISIT))
    assert isinstance(refused.value.__cause__, InstanceFailed)   # what the last one raised
    assert path.counters.instance_errors == 3 and path.counters.requests == 0


def test_shedding_is_counted_on_both_legs() -> None:
    fleet = ScriptedFleet(["shed"], shed_first=True)
    path = make_path(fleet)
    before = path.store.num_events(3)
    with pytest.raises(OverloadedError):
        asyncio.run(path.recommend(VISIT))
    assert path.counters.shed_preinfer == 1 and path.counters.shed_rank == 1
    assert path.store.num_events(3) == before          # nothing appended
    assert len(fleet.ranked) == 1                      # a shed leg is not sent elsewhere


@pytest.mark.parametrize("deferred", [False, True])
def test_prefill_is_remembered_until_its_ranking_leg(deferred: bool) -> None:
    fleet = ScriptedFleet(["a"], deferred=deferred)
    path = make_path(fleet)

    async def main() -> None:
        assert await path.prefill(3, 2, 8) == ("a", DONE)
        assert path.remembered_prefills == 1
        rec = await path.rank_candidates(VISIT, torch.arange(1, 9))
        assert rec.preinfer is None and rec.preinfer_instance is None
    asyncio.run(main())
    assert path.remembered_prefills == 0
    assert [send for _, send in fleet.sent] == [True, False]


def test_modes_without_preinfer_send_no_signal() -> None:
    fleet = ScriptedFleet(["a"])
    rec = asyncio.run(make_path(fleet, "baseline").recommend(VISIT))
    assert [send for _, send in fleet.sent] == [False] and rec.preinfer is None
    # an explicit pre-infer signal is bad input there (422), not a missing instance (503)
    with pytest.raises(PreinferDisabledError, match="does not pre-infer"):
        asyncio.run(make_path(fleet, "baseline").prefill(3, 2, 8))
    assert len(fleet.sent) == 1                        # nothing was sent


def test_the_shed_rules_bound_at_their_depths() -> None:
    cfg = SystemConfig(overload=OverloadConfig(shed_preinfer_queue_depth=3,
                                               max_rank_queue_depth=5), slo_ms=250)
    assert not sheds_preinfer(2, cfg) and sheds_preinfer(3, cfg)
    assert rank_shed("r", 4, cfg) is None
    shed = rank_shed("r", 5, cfg)
    assert isinstance(shed, OverloadedError) and shed.retry_after_s == 0.25
    assert str(shed) == "r has 5 ranking requests queued"


def test_the_earlier_stages_run_from_the_requests_arrival_beside_the_signal() -> None:
    """The simulated stages' fleets start on the request when it arrives, as the pre-infer
    signal is sent: work done before their call (the signal, the history read) is inside
    their window, not added to it. On the loop's virtual clock: 70 ms of stages, 50 ms of
    which had passed before the call, leave 20 ms to wait."""
    model = make_model(0, num_items=NUM_ITEMS)
    stages = EarlierStages(EmbeddingRetrieval.of(model, 16, recency=1.0), 64, 0.040, 0.030)
    history = np.arange(1, 30)

    async def waited(before_s: float) -> float:
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        await asyncio.sleep(before_s)                 # the first leg's work, as the loop sees it
        start = loop.time()
        await stages.run(history, 8, 3, arrived)
        return loop.time() - start

    assert run_virtual(waited(0.050)) == pytest.approx(0.020, abs=1e-9)
    assert run_virtual(waited(0.100)) == pytest.approx(0.0, abs=1e-9)   # already past it
    stages.shutdown()


class RoutedFleet(ScriptedFleet):
    """A ``ScriptedFleet`` whose first legs go where ``routes`` say, in turn (a spill to "b",
    say), and whose ranking legs answer where they follow (or "a", routed afresh)."""

    def __init__(self, routes: list[str]) -> None:
        super().__init__([])
        self.routes = list(routes)

    def preinfer(self, request_id: str, user_id: int, spec: PrefixSpec, suffix_tokens: int,
                 candidates: int, send: bool) -> FirstLeg | Awaitable[FirstLeg]:
        self.sent.append((request_id, send))
        name = self.routes.pop(0)
        route = RouteDecision(user_id, name, 0, name != "a",
                              RouteReason.OWNER if name == "a" else RouteReason.SPILLED)
        return FirstLeg(route, name, DONE) if send else FirstLeg(route)

    async def rank(self, request_id: str, user_id: int, first: RouteDecision | None,
                   job: RankJob, avoid: tuple[str, ...]) -> RankedLeg:
        self.answers.append("a" if first is None else first.instance_id)
        return await super().rank(request_id, user_id, first, job, avoid)


def test_a_newer_first_leg_of_the_user_replaces_a_remembered_prefill() -> None:
    """A ``prefill`` (spilled to "b") followed by a ``recommend`` of the same user (its own first
    leg, to "a", and its ranking leg there): a later ``rank_candidates`` is not that prefill's
    ranking leg any more, and goes where its own first leg goes, not to the old spill."""
    fleet = RoutedFleet(["b", "a", "a"])
    path = make_path(fleet)

    async def main() -> None:
        await path.prefill(3, 2, 8)
        prefill_id = fleet.sent[0][0]
        assert (await path.recommend(VISIT)).instance == "a"
        rec = await path.rank_candidates(Visit(3, num_candidates=8), torch.arange(1, 9))
        assert rec.instance == "a"
        (rid, first, _), = fleet.ranked[-1:]
        assert rid != prefill_id and first is not None and first.instance_id == "a"
        assert path.remembered_prefills == 0
    asyncio.run(main())


def test_a_remembered_prefill_expires_with_its_lease() -> None:
    """A ``prefill`` whose ranking leg has not come within the pre-infer's lease is forgotten: its
    prefix is no longer kept for it, so a later ``rank_candidates`` is routed afresh (not to the
    old spill), and prefills never followed by a ranking leg are not kept."""
    fleet = RoutedFleet(["b", "a", "b", "b", "b"])
    path = make_path(fleet)
    lease_s = path.config.instance.lease_s

    async def main() -> None:
        await path.prefill(3, 2, 8)
        await asyncio.sleep(lease_s)
        rec = await path.rank_candidates(Visit(3, num_candidates=8), torch.arange(1, 9))
        assert rec.instance == "a"
        for user in (4, 5):
            await path.prefill(user, 0, 8)
        await asyncio.sleep(lease_s)
        await path.prefill(6, 0, 8)
        assert path.remembered_prefills == 1          # users 4 and 5's have expired
    run_virtual(main())


@pytest.mark.parametrize("deferred", [False, True])
def test_a_preinfer_whose_ranking_leg_will_not_come_is_abandoned_where_it_went(
        deferred: bool) -> None:
    """Its instance is told (``Fleet.abandon``) when the ranking leg fails over, is shed or
    fails everywhere; not when the leg ranks where the signal went, nor for a shed signal."""
    def abandoned(answers: list[str], shed_first: bool = False) -> list[tuple[str, str | None]]:
        fleet = ScriptedFleet(answers, deferred=deferred, shed_first=shed_first)
        with contextlib.suppress(OverloadedError, NoHealthyInstanceError):
            asyncio.run(make_path(fleet).recommend(VISIT))
        assert all(rid == fleet.sent[0][0] for rid, _ in fleet.abandoned)
        return fleet.abandoned

    assert [i for _, i in abandoned(["a"])] == []
    assert [i for _, i in abandoned(["b"])] == ["a"]            # moved off it
    assert [i for _, i in abandoned(["raised", "b"])] == ["a"]
    assert [i for _, i in abandoned(["shed"])] == ["a"]
    assert [i for _, i in abandoned(["lost"] * 3)] == ["a"]
    assert abandoned(["shed"], shed_first=True) == []         # it never ran there
