"""The earlier stages: retrieval's kept candidates and their scores, refills, the candidate book."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from relaygr.cascade.proposals import EmbeddingRetrieval
from relaygr.cascade.stages import CandidateBook, EarlierStages
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation
from relaygr.errors import NoCandidatesError
from tests.cascade.test_system import NUM_ITEMS, config, histories, serve, visits
from tests.engine.helpers import flops_cost_model
from tests.model.helpers import make_model


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
