"""The sliding history window: where it starts, its versions, and exact scores across slides."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaygr.cascade.config import StagesConfig, SystemConfig
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.cascade.window import HistoryWindow
from relaygr.engine.instance import InstanceConfig
from relaygr.engine.transport.payload import PrefixPayload
from relaygr.engine.types import RankPath
from relaygr.errors import ConfigError, SequenceTooLongError
from relaygr.model import HSTU
from tests.cascade.replay import replay
from tests.engine.helpers import flops_cost_model
from tests.model.helpers import make_model
from tests.tolerance import SCORE_TOL

NUM_ITEMS = 300
WIDTH = 48          # the test model's max_seq_len: a few visits slide it


def test_the_window_starts_on_block_boundaries_and_holds_at_most_max_tokens() -> None:
    window = HistoryWindow(max_tokens=8, slide_tokens=3)
    assert [window.start(t) for t in (1, 8, 9, 11, 12, 14, 15)] == [0, 0, 3, 3, 6, 6, 9]
    for total in range(1, 200):
        start = window.start(total)
        assert (start % 3 == 0 and 8 - 3 < total - start <= 8) or (start == 0 and total <= 8)
        assert window.start(total + 1) >= start                 # it only moves forward
    assert not window.slid(8, 8) and window.slid(8, 9) and not window.slid(9, 11)
    assert window.slid(9, 40)                                   # one slide however far
    assert window.max_suffix_tokens == 5
    window.check_suffix(5, "recent_items")
    with pytest.raises(SequenceTooLongError, match="recent_items holds 6 events; a visit adds "
                                                   "at most 5"):
        window.check_suffix(6, "recent_items")


def test_window_configuration_is_checked() -> None:
    for bad in ((8, 0), (8, 8), (1, 1)):
        with pytest.raises(ConfigError, match="slide_tokens < max_tokens"):
            HistoryWindow(*bad)
    for fraction in (0.0, 0.6, -1.0):
        with pytest.raises(ConfigError, match="window_slide_fraction"):
            SystemConfig(window_slide_fraction=fraction)
    model = make_model(0, num_items=NUM_ITEMS, max_seq_len=WIDTH).cfg
    assert HistoryWindow.for_model(model, SystemConfig()) == HistoryWindow(WIDTH, 6)
    assert HistoryWindow.for_model(model, SystemConfig(window_slide_fraction=0.01)) == \
        HistoryWindow(WIDTH, 1)


def _store(lengths: dict[int, int], seed: int = 0) -> InMemoryHistoryStore:
    rng = np.random.default_rng(seed)
    return InMemoryHistoryStore.from_sequences(
        {user: (rng.integers(1, NUM_ITEMS + 1, n),
                1_600_000_000 + np.cumsum(rng.integers(0, 5_000, n))) for user, n in
         lengths.items()}, num_items=NUM_ITEMS)


def test_window_versions_hash_the_start_and_agree_everywhere() -> None:
    store = _store({1: 30})
    items, ts = store.get(1).items, store.get(1).timestamps
    assert ts is not None
    assert store.version_at(1, 30, 0) == store.version_at(1, 30) == store.get(1).version
    windows = {store.version_at(1, 30, start) for start in range(30)}
    assert len(windows) == 30           # the same tail read from another start: another version
    assert store.version_at(1, 20, 6) != store.version_at(1, 14)
    # a visit's grown key is the version its events will have once stored
    after = store.version_after(1, 30, [5, 6], [int(ts[-1]), int(ts[-1]) + 1], start=6)
    store.append(1, [5, 6], [int(ts[-1]), int(ts[-1]) + 1])
    assert after == store.version_at(1, 32, 6)
    # across a process boundary the receiver rebuilds every shorter version from the events
    window = HistoryWindow(24, 6)
    split = window.prefix(store, 1, suffix_tokens=2)
    payload = split.payload
    assert split.held == 0
    assert payload.window_start == 12 and payload.pid.num_tokens == 20
    np.testing.assert_array_equal(payload.items, np.concatenate([items, [5, 6]])[12:])
    spec = PrefixPayload(payload.pid, payload.items.copy(), payload.timestamps,
                         payload.window_start).to_spec()
    assert spec.window_start == 12
    assert [spec.version_at(m) for m in range(1, 21)] == \
        [store.version_at(1, 12 + m, 12) for m in range(1, 21)]
    grown = window.grown(store, split, [7], [int(ts[-1]) + 2])
    store.append(1, [7], [int(ts[-1]) + 2])
    assert grown == window.prefix(store, 1, suffix_tokens=0).payload.pid
    with pytest.raises(SequenceTooLongError):
        window.prefix(store, 1, suffix_tokens=19)


def _config(mode: str, fraction: float) -> SystemConfig:
    # A tiny SLO puts every prefix at risk, so the relay modes pre-infer.
    return SystemConfig(mode=mode, slo_ms=0.01, num_instances=2,
                        stages=StagesConfig(retrieval_k=32, num_candidates=12,
                                            retrieval_delay_ms=1, preprocess_delay_ms=1),
                        instance=InstanceConfig(device_budget_bytes=4 << 20,
                                                host_budget_bytes=8 << 20, page_tokens=8),
                        window_slide_fraction=fraction)


def _visits(sizes: list[int], users: list[int], store: InMemoryHistoryStore) -> list[Visit]:
    rng = np.random.default_rng(len(sizes))
    last = {user: int(store.get(user).timestamps[-1]) for user in users}  # type: ignore[index]
    out = []
    for i, size in enumerate(sizes):
        user = users[i % len(users)]
        ts = tuple(last[user] + 1 + k for k in range(size))
        last[user] = ts[-1] + 1
        items = tuple(int(x) for x in rng.integers(1, NUM_ITEMS + 1, size))
        out.append(Visit(user, items, ts, last[user]))
    return out


def _full_pass(model: HSTU, history: tuple[np.ndarray, np.ndarray], visit: Visit,
               fraction: float, candidates: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The reference: the window's start from its definition, and a fresh full pass over it."""
    items, ts = history
    block = max(1, int(WIDTH * fraction))
    total = len(items) + len(visit.recent_items)
    start = 0 if total <= WIDTH else -(-(total - WIDTH) // block) * block
    scores = model.rank(candidates, prefix_items=torch.tensor(items[start:]),
                        prefix_timestamps=torch.tensor(ts[start:]),
                        suffix_items=torch.tensor(visit.recent_items),
                        suffix_timestamps=torch.tensor(visit.recent_timestamps),
                        query_timestamp=visit.request_ts)
    return start, scores


def _serve(mode: str, fraction: float, visits: list[Visit], store: InMemoryHistoryStore,
           model: HSTU) -> tuple[list[tuple[Recommendation, int, torch.Tensor]], RelaySystem]:
    system = RelaySystem(_config(mode, fraction), model, store, flops_cost_model(model.cfg))
    served = replay(system, store, visits, lambda history, visit, rec: _full_pass(
        model, history, visit, fraction, rec.candidates))
    return [(rec, start, want) for rec, (start, want) in served], system


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["relay", "reactive", "baseline"]),
       fraction=st.sampled_from([0.125, 0.25, 0.5]),
       sizes=st.lists(st.integers(1, 5), min_size=24, max_size=24),
       first=st.integers(WIDTH - 4, WIDTH + 30))
def test_cached_scores_equal_a_full_pass_of_the_window_after_any_number_of_slides(
        mode: str, fraction: float, sizes: list[int], first: int) -> None:
    model = make_model(0, num_items=NUM_ITEMS, max_seq_len=WIDTH, dim=16, query_block=32,
                       candidate_block=8)
    store = _store({1: first, 2: WIDTH - 1})
    window = HistoryWindow.for_model(model.cfg, _config(mode, fraction))
    slides = 0
    lengths = {1: first, 2: WIDTH - 1}
    for visit in (plan := _visits(sizes, [1, 2], store)):
        after = lengths[visit.user_id] + len(visit.recent_items)
        slides += window.slid(lengths[visit.user_id], after)
        lengths[visit.user_id] = after
    assert slides >= 2
    served, system = _serve(mode, fraction, plan, store, model)
    for rec, start, want in served:
        assert rec.window_start == start
        assert rec.prefix_tokens + rec.suffix_tokens <= WIDTH
        torch.testing.assert_close(rec.scores, want, atol=SCORE_TOL, rtol=SCORE_TOL)
    assert system.counters.window_slides == slides
    windowed = [rec for rec, start, _ in served if start > 0]
    assert system.counters.windowed_requests == len(windowed) > 0
    if mode != "baseline":      # the relay still reuses the cache after the window moved
        assert any(rec.path is not RankPath.FULL for rec in windowed)
