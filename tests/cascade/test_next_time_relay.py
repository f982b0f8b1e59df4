"""The relay serving a model whose time bias reads the next event's time (``time_query="next"``):
the held-back event, identities salted with the continuation time, and exact scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaygr.cascade.config import StagesConfig, SystemConfig
from relaygr.cascade.instances import build_instance
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.cascade.window import HistoryWindow
from relaygr.engine.instance import InstanceConfig
from relaygr.engine.transport.processes import InstanceProcesses
from relaygr.engine.types import PreinferAction, RankPath
from relaygr.engine.versions import continued
from relaygr.kvcache import DeviceKVPool, KVLayout, PrefixId
from relaygr.model import HSTU, RankInput, concat_prefix
from tests.cascade.replay import replay
from tests.engine.helpers import flops_cost_model
from tests.model.helpers import make_model
from tests.tolerance import SCORE_TOL

NUM_ITEMS = 300
WIDTH = 48          # the test model's max_seq_len: a few visits slide it
T0 = 1_600_000_000


def _model() -> HSTU:
    return make_model(0, num_items=NUM_ITEMS, max_seq_len=WIDTH, dim=16, query_block=32,
                      candidate_block=8, time_query="next")


def _store(lengths: dict[int, int], seed: int = 0) -> InMemoryHistoryStore:
    rng = np.random.default_rng(seed)
    return InMemoryHistoryStore.from_sequences(
        {user: (rng.integers(1, NUM_ITEMS + 1, n), T0 + np.cumsum(rng.integers(1, 5_000, n)))
         for user, n in lengths.items()}, num_items=NUM_ITEMS)


def _config(mode: str) -> SystemConfig:
    # A tiny SLO puts every prefix at risk, so the relay modes pre-infer.
    return SystemConfig(mode=mode, slo_ms=0.01, num_instances=2,
                        stages=StagesConfig(retrieval_k=32, num_candidates=12,
                                            retrieval_delay_ms=1, preprocess_delay_ms=1),
                        instance=InstanceConfig(device_budget_bytes=4 << 20,
                                                host_budget_bytes=8 << 20, page_tokens=8),
                        window_slide_fraction=0.25)


def _visits(sizes: list[int], users: list[int], store: InMemoryHistoryStore,
            seed: int) -> list[Visit]:
    """Visits of ``sizes`` events (0: a request adding none), some without a request time."""
    rng = np.random.default_rng(seed)
    last = {user: int(store.get(user).timestamps[-1]) for user in users}  # type: ignore[index]
    out = []
    for i, size in enumerate(sizes):
        user = users[i % len(users)]
        ts = tuple(last[user] + int(g) for g in np.cumsum(rng.integers(1, 900, size)))
        last[user] = (ts[-1] if ts else last[user]) + int(rng.integers(0, 900))
        items = tuple(int(x) for x in rng.integers(1, NUM_ITEMS + 1, size))
        request_ts = None if i % 5 == 4 else last[user]
        out.append(Visit(user, items, ts if size else None, request_ts))
    return out


def _full_pass(model: HSTU, history: tuple[np.ndarray, np.ndarray], visit: Visit,
               candidates: torch.Tensor) -> torch.Tensor:
    """The reference: a fresh full pass over the window, by its definition."""
    items, ts = history
    block = max(1, int(WIDTH * 0.25))
    total = len(items) + len(visit.recent_items)
    start = 0 if total <= WIDTH else -(-(total - WIDTH) // block) * block
    new = visit.recent_items or None
    return model.rank(candidates, prefix_items=torch.tensor(items[start:]),
                      prefix_timestamps=torch.tensor(ts[start:]),
                      suffix_items=None if new is None else torch.tensor(new),
                      suffix_timestamps=None if new is None
                      else torch.tensor(visit.recent_timestamps),
                      query_timestamp=visit.request_ts)


def _serve(mode: str, visits: list[Visit], store: InMemoryHistoryStore, model: HSTU,
           processes: InstanceProcesses | None = None
           ) -> tuple[list[tuple[Recommendation, torch.Tensor]], RelaySystem]:
    system = RelaySystem(_config(mode), model, store, flops_cost_model(model.cfg),
                         instance_factory=None if processes is None else processes.factory)
    return replay(system, store, visits, lambda history, visit, rec: _full_pass(
        model, history, visit, rec.candidates)), system


@pytest.mark.parametrize("mode", ["relay", "reactive", "baseline"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(0, 4), min_size=24, max_size=24),
       first=st.integers(WIDTH - 6, WIDTH + 20), seed=st.integers(0, 2 ** 16))
def test_a_next_time_model_is_served_exactly_across_visits_slides_and_tiers(
        mode: str, sizes: list[int], first: int, seed: int) -> None:
    """Every visit's scores equal a full pass of its window, in every mode, while the cache is
    reused: the prefix a ranking leaves behind is the next visit's, continuation included. User
    3 starts with a single event (nothing held back: a prefix computed for the visit's time)."""
    model = _model()
    store = _store({1: first, 2: WIDTH - 2, 3: 1}, seed)
    plan = _visits(sizes, [1, 2, 3], store, seed)
    served, system = _serve(mode, plan, store, model)
    for rec, want in served:
        torch.testing.assert_close(rec.scores, want, atol=SCORE_TOL, rtol=SCORE_TOL)
    if mode == "relay":
        # a later visit found the prefix the previous visit's ranking kept, on the device or on
        # the host (its identity carries its continuation time: else it would be another prefix)
        later = [rec for rec, _ in served[3:] if rec.preinfer is not None]
        assert any(rec.preinfer.action in (PreinferAction.ON_DEVICE,  # type: ignore[union-attr]
                                           PreinferAction.RELOAD) for rec in later)
    if mode != "baseline":
        assert any(rec.path is not RankPath.FULL for rec, _ in served[3:])
    assert system.counters.requests == len(plan)


def test_a_single_event_is_computed_for_each_visits_time() -> None:
    """A user with one event and visits adding none: each visit's prefix is that event computed
    for its own request time, so the one cached for an earlier request is another prefix (not
    served with the wrong time), until events follow it."""
    model = _model()
    store = _store({5: 1})
    t = int(store.get(5).timestamps[0])  # type: ignore[index]
    plan = [Visit(5, (), None, t + 100), Visit(5, (), None, t + 250), Visit(5, (), None, None),
            Visit(5, (9, 10), (t + 400, t + 460), t + 500), Visit(5, (), None, t + 900),
            Visit(5, (), None, t + 990)]
    served, _ = _serve("relay", plan, store, model)
    for rec, want in served:
        torch.testing.assert_close(rec.scores, want, atol=SCORE_TOL, rtol=SCORE_TOL)
    actions = [rec.preinfer.action for rec, _ in served]  # type: ignore[union-attr]
    assert PreinferAction.ON_DEVICE not in actions[:4]    # each its own continuation
    assert actions[5] is PreinferAction.ON_DEVICE         # held back: the same prefix again


@pytest.mark.slow
def test_instances_in_processes_serve_a_next_time_model_exactly() -> None:
    """The prefix crosses the process boundary as events with its continuation time, and the
    receiver's versions (``PrefixPayload.to_spec``) are the sender's: its kept prefixes are
    found again."""
    model = _model()
    store = _store({1: WIDTH + 3, 2: WIDTH - 2, 3: 1}, 7)
    plan = _visits([2, 0, 3, 1, 4, 0, 2, 1] * 2, [1, 2, 3], store, 7)
    processes = InstanceProcesses.for_model(model, flops_cost_model(model.cfg), 2,
                                            build=build_instance)
    try:
        served, _ = _serve("relay", plan, store, model, processes)
    finally:
        processes.close()
    for rec, want in served:
        torch.testing.assert_close(rec.scores, want, atol=SCORE_TOL, rtol=SCORE_TOL)
    assert any(rec.preinfer is not None and rec.preinfer.action is PreinferAction.ON_DEVICE
               for rec, _ in served)
    assert not any(rec.path is RankPath.FULL for rec, _ in served)


def test_the_window_holds_back_the_newest_event_and_salts_the_identity_with_its_time() -> None:
    store = _store({1: 20, 2: 1})
    history = store.get(1)
    ts = history.timestamps
    assert ts is not None
    window = HistoryWindow(WIDTH, 12, next_time_query=True)
    split = window.prefix(store, 1, suffix_tokens=2)
    payload = split.payload
    assert split.held == 1 and payload.pid.num_tokens == 19
    assert payload.next_timestamp == int(ts[19]) and int(split.held_items[0]) == history.items[19]
    events = store.version_at(1, 19)
    assert payload.pid.version == continued(events, int(ts[19])) != events
    # the receiver's versions of every shorter prefix carry each one's continuation: the next
    # event's time
    spec = payload.to_spec()
    assert spec.next_timestamp == int(ts[19])
    assert [spec.version_at(n) for n in range(1, 20)] == \
        [continued(store.version_at(1, n), int(ts[n])) for n in range(1, 20)]
    # what a visit of two events leaves behind is the next visit's prefix
    new_ts = [int(ts[-1]) + 5, int(ts[-1]) + 9]
    grown = window.grown(store, split, [7, 8], new_ts)
    assert window.grown(store, split, [], None) is None
    store.append(1, [7, 8], new_ts)
    nxt = window.prefix(store, 1, suffix_tokens=0).payload
    assert grown == nxt.pid and grown.num_tokens == 21 and nxt.next_timestamp == new_ts[1]
    # a single stored event is not held back: its prefix goes on at the visit's time
    single = window.prefix(store, 2, suffix_tokens=1, continues_at=T0 + 10 ** 6)
    assert single.held == 0 and single.payload.next_timestamp == T0 + 10 ** 6
    assert single.payload.pid != window.prefix(store, 2, 0).payload.pid
    # an untimed history or an own-time model: nothing held back, nothing salted
    own = HistoryWindow(WIDTH, 12).prefix(store, 1, suffix_tokens=0)
    assert own.held == 0 and own.payload.next_timestamp is None
    assert own.payload.pid == PrefixId(1, 22, store.version_at(1, 22))


def test_a_ranking_pass_keeps_all_but_its_last_token_for_the_next_continuation() -> None:
    """``RankOutput.computed`` of a next-time model ends one token short, and continues at that
    token's time: joined to the prefix, it is what a prefill of those events computes."""
    model = make_model(2, time_query="next", max_seq_len=256)
    rng = np.random.default_rng(4)
    items = torch.tensor(rng.integers(1, 500, 90))
    ts = torch.tensor(T0 + np.cumsum(rng.integers(1, 3_000, 90)))
    cands = torch.tensor(rng.integers(1, 500, 20))
    prefix = model.prefill(items[:60], ts[:60], next_timestamp=int(ts[60]))
    for new in (1, 2, 30):      # the kept part: none, only the held event's predecessor, most
        end = 60 + new
        out = model.rank_batch_outputs([RankInput(
            cands, prefix=prefix, suffix_items=items[60:end], suffix_timestamps=ts[60:end],
            query_timestamp=int(ts[end - 1]) + 50)])[0]
        if new == 1:
            assert out.computed is None
            continue
        assert out.computed is not None and out.computed.num_tokens == new - 1
        assert out.computed.next_timestamp == int(ts[end - 1])
        kept = concat_prefix(prefix, out.computed)
        want = model.prefill(items[:end - 1], ts[:end - 1], next_timestamp=int(ts[end - 1]))
        torch.testing.assert_close(kept.k, want.k, atol=SCORE_TOL, rtol=SCORE_TOL)
        torch.testing.assert_close(kept.v, want.v, atol=SCORE_TOL, rtol=SCORE_TOL)
        torch.testing.assert_close(kept.last_hidden, want.last_hidden, atol=SCORE_TOL,
                                   rtol=SCORE_TOL)
    # a full pass keeps the whole history but its last token
    full = model.rank_batch_outputs([RankInput(cands, prefix_items=items, prefix_timestamps=ts,
                                               query_timestamp=int(ts[-1]) + 50)])[0]
    assert full.computed is not None and full.computed.num_tokens == 89
    assert full.computed.next_timestamp == int(ts[-1])


def test_the_device_pool_keeps_each_entrys_continuation_time() -> None:
    model = make_model(2, time_query="next", max_seq_len=256)
    rng = np.random.default_rng(5)
    items = torch.tensor(rng.integers(1, 500, 40))
    ts = torch.tensor(T0 + np.cumsum(rng.integers(1, 3_000, 40)))
    base = model.prefill(items[:25], ts[:25], next_timestamp=int(ts[25]))
    whole = model.prefill(items[25:39], ts[25:39], past=base, next_timestamp=int(ts[39]))
    pool = DeviceKVPool(KVLayout.for_model(model.cfg), 4 << 20, page_tokens=8)
    pid = PrefixId(1, 39, 11)
    pending = pool.begin(pid, timed=True)
    assert pending is not None
    pool.write(pending, base)
    assert pool.written_view(pending, 25).next_timestamp == int(ts[25])
    pool.write(pending, whole)           # all 39 tokens: this write ends the entry
    # a shorter view of the written tokens goes on at its next token's time
    assert pool.written_view(pending, 20).next_timestamp == int(ts[20])
    pool.commit(pending)
    kv = pool.acquire(pid)
    assert kv is not None and kv.next_timestamp == int(ts[39])
    cands = torch.tensor(rng.integers(1, 500, 10))
    torch.testing.assert_close(
        model.rank(cands, prefix=kv, suffix_items=items[39:], suffix_timestamps=ts[39:],
                   query_timestamp=int(ts[39]) + 7),
        model.rank(cands, prefix_items=items, prefix_timestamps=ts,
                   query_timestamp=int(ts[39]) + 7), atol=SCORE_TOL, rtol=SCORE_TOL)
    pool.release(pid)
