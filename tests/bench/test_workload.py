"""Workloads: seeded reproducibility, invariants, and their documented statistics."""

from __future__ import annotations

import gzip
import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.bench.workload import (
    DLRMv3Config,
    DLRMv3Workload,
    FixedLength,
    LogNormalLength,
    ML1MConfig,
    ML1MWorkload,
    SyntheticConfig,
    SyntheticWorkload,
    Workload,
    ZipfSampler,
    length_distribution,
    read_ml1m,
    summarize,
    workload_builder,
)
from relaygr.bench.workload.ml1m import DEFAULT_PATH
from relaygr.errors import ConfigError

SMALL = SyntheticConfig(num_users=500, num_items=2000, num_candidates=64,
                        prefix_len=LogNormalLength(median=200, sigma=0.5, max_tokens=800))


def assert_consistent(workload: Workload) -> None:
    """The invariants every workload promises (see ``Workload`` and ``BenchRequest``)."""
    requests = workload.requests
    assert [r.request_id for r in requests] == list(range(len(requests)))
    assert all(a.send_s <= b.send_s for a, b in itertools.pairwise(requests))
    last_ts: dict[int, int | None] = {u: h.last_ts for u, h in workload.histories.items()}
    for history in workload.histories.values():
        assert history.items.min() >= 1 and history.items.max() <= workload.num_items
        assert not history.items.flags.writeable
        if history.timestamps is not None:
            assert np.all(np.diff(history.timestamps) >= 0)
    for r in requests:
        assert r.user_id in workload.histories and r.recent_items
        assert min(r.recent_items) >= 1 and max(r.recent_items) <= workload.num_items
        if r.request_ts is None:
            assert r.recent_timestamps is None
            continue
        assert r.recent_timestamps is not None
        stamps = list(r.recent_timestamps)
        assert stamps == sorted(stamps) and stamps[-1] <= r.request_ts
        previous = last_ts[r.user_id]
        assert previous is None or previous <= stamps[0]
        last_ts[r.user_id] = r.request_ts


def test_synthetic_is_seeded_and_reproducible() -> None:
    a = SyntheticWorkload(SMALL, seed=3).build(50.0, 300)
    b = SyntheticWorkload(SMALL, seed=3).build(50.0, 300)
    c = SyntheticWorkload(SMALL, seed=4).build(50.0, 300)
    assert a.requests == b.requests and a.requests != c.requests
    assert a.histories.keys() == b.histories.keys()
    for user, history in a.histories.items():
        assert np.array_equal(history.items, b.histories[user].items)
    assert_consistent(a)
    assert_consistent(c)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 1.0), st.booleans(), st.floats(1.0, 6.0),
       st.sampled_from([None, 2, 5]), st.floats(1.0, 200.0))
def test_synthetic_invariants_hold_for_any_config(seed: int, short_share: float, timed: bool,
                                                  recent_mean: float, cap: int | None,
                                                  qps: float) -> None:
    cfg = SyntheticConfig(num_users=60, num_items=300, short_gap_share=short_share,
                          timed=timed, recent_events_mean=recent_mean, max_visits_per_user=cap,
                          prefix_len=LogNormalLength(median=20, sigma=1.0, max_tokens=64))
    workload = SyntheticWorkload(cfg, seed=seed).build(qps, 100)
    assert_consistent(workload)
    assert len(workload.requests) == 100
    assert all((r.request_ts is not None) == timed for r in workload.requests)
    if cap is not None:
        assert summarize(workload).visits_per_user.max <= cap


def test_arrivals_are_poisson_and_scale_with_qps() -> None:
    builder = SyntheticWorkload(SMALL, seed=1)
    slow, fast = builder.build(20.0, 2000), builder.build(40.0, 2000)
    send_slow = np.array([r.send_s for r in slow.requests])
    send_fast = np.array([r.send_s for r in fast.requests])
    assert np.allclose(send_fast, send_slow / 2)  # common random numbers across QPS
    gaps = np.diff(send_slow)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.07)
    assert gaps.std() == pytest.approx(1 / 20, rel=0.1)  # exponential: std = mean


def test_a_user_is_the_same_whoever_else_visits() -> None:
    builder = SyntheticWorkload(SMALL, seed=2)
    a, b = builder.build(10.0, 200), builder.build(80.0, 200)
    for user in set(a.histories) & set(b.histories):
        assert np.array_equal(a.histories[user].items, b.histories[user].items)


def test_fixed_length_mode() -> None:
    workload = SyntheticWorkload(SMALL.with_fixed_length(512), seed=0).build(30.0, 400)
    assert {len(h) for h in workload.histories.values()} == {512}
    prefix = workload.prefix_tokens_at_visit()
    grown: dict[int, int] = {}
    for r, tokens in zip(workload.requests, prefix.tolist(), strict=True):
        assert tokens == 512 + grown.get(r.user_id, 0)
        grown[r.user_id] = grown.get(r.user_id, 0) + len(r.recent_items)
    assert SMALL.max_visits_per_user is not None
    assert summarize(workload).visits_per_user.max <= SMALL.max_visits_per_user


def test_lognormal_default_lengths() -> None:
    dist = LogNormalLength()
    lengths = dist.sample(np.random.default_rng(0), 40_000)
    assert np.median(lengths) == pytest.approx(2000, rel=0.03)
    assert lengths.min() >= 32 and lengths.max() == 8192
    assert np.mean(lengths == 8192) == pytest.approx(0.03, abs=0.01)  # the clipped tail
    assert length_distribution({"kind": "fixed", "tokens": 7}) == FixedLength(7)
    with pytest.raises(ConfigError):
        length_distribution({"kind": "uniform"})
    with pytest.raises(ConfigError):
        length_distribution({"kind": "fixed", "length": 7})


def test_zipf_sampler_skew() -> None:
    zipf = ZipfSampler(1000, 1.0, seed=0)
    draws = zipf.sample(np.random.default_rng(1), 200_000)
    counts = np.bincount(draws, minlength=1001)
    by_rank = counts[zipf.id_of_rank]
    assert by_rank[0] / 200_000 == pytest.approx(zipf.probability_of_rank(1), rel=0.03)
    ranks = np.arange(1, 51)
    slope = np.polyfit(np.log(ranks), np.log(by_rank[:50]), 1)[0]
    assert slope == pytest.approx(-1.0, abs=0.08)
    assert sorted(zipf.id_of_rank.tolist()) == list(range(1, 1001))


def test_synthetic_user_popularity_is_zipf() -> None:
    cfg = SyntheticConfig(num_users=200, num_items=500, user_zipf_s=1.0, short_gap_share=0.0,
                          max_visits_per_user=None, prefix_len=FixedLength(4))
    builder = SyntheticWorkload(cfg, seed=0)
    workload = builder.build(100.0, 3000)
    visits = np.bincount([r.user_id for r in workload.requests], minlength=201)
    top = visits[builder.users.id_of_rank[0]] / 3000
    assert top == pytest.approx(builder.users.probability_of_rank(1), rel=0.1)


def test_short_gap_users_revisit_within_seconds() -> None:
    def build(share: float) -> Workload:
        cfg = SyntheticConfig(num_users=50_000, num_items=500, user_zipf_s=0.2,
                              short_gap_share=share, short_gap_mean_s=2.0, session_visits=4,
                              prefix_len=FixedLength(4))
        return SyntheticWorkload(cfg, seed=0).build(20.0, 2000)

    sessions, none = summarize(build(1.0)), summarize(build(0.0))
    # each session is 1 Zipf visit + 3 follow-ups ~2 s apart
    assert sessions.revisits_within_60s_share == pytest.approx(0.75, abs=0.05)
    assert sessions.revisit_gap_s.p50 < 3.0
    assert none.revisits_within_60s_share < 0.05


def test_visit_cap_is_enforced_and_validated() -> None:
    cfg = SyntheticConfig(num_users=10, num_items=50, max_visits_per_user=3,
                          prefix_len=FixedLength(4))
    workload = SyntheticWorkload(cfg, seed=0).build(5.0, 30)
    assert max(summarize(workload).visits_per_user.max, 0) == 3
    with pytest.raises(ConfigError):
        SyntheticWorkload(cfg, seed=0).build(5.0, 31)
    with pytest.raises(ConfigError):
        SyntheticConfig.from_dict({"num_users": 5, "bogus": 1})
    parsed = SyntheticConfig.from_dict({"prefix_len": {"kind": "fixed", "tokens": 9},
                                        "stage_delays": {"retrieval_ms": 1.0}})
    assert parsed.prefix_len == FixedLength(9) and parsed.stage_delays.total_s == 0.031


def test_dlrmv3_matches_the_published_profile() -> None:
    builder = DLRMv3Workload(DLRMv3Config(num_items=2000), seed=0)
    workload = builder.build(100.0, 3500)
    s = summarize(workload)
    assert s.users == 500 and s.visits_per_user.min == s.visits_per_user.max == 7
    assert s.suffix_tokens.min == s.suffix_tokens.max == 100
    assert s.candidates.min == s.candidates.max == 2048
    assert s.history_at_query.mean == pytest.approx(6716, rel=0.01)
    assert s.history_at_query.std == pytest.approx(531, rel=0.08)
    assert s.history_at_query.min >= 4450 and s.history_at_query.max <= 9080
    assert builder.config.model_shape() == {"num_layers": 5, "dim": 512, "num_heads": 4}
    assert_consistent(workload)


def test_dlrmv3_cpu_scale() -> None:
    cfg = DLRMv3Config.cpu()
    assert cfg.num_candidates == 256 and cfg.events_per_visit == 12
    assert cfg.history_at_query() == {"mean": 840, "std": 66, "min": 556, "max": 1135}
    assert cfg.model_shape() == {"num_layers": 5, "dim": 128, "num_heads": 4}
    s = summarize(DLRMv3Workload(replace(cfg, num_items=2000), seed=1).build(100.0, 3500))
    assert s.history_at_query.mean == pytest.approx(840, rel=0.01)
    assert s.history_at_query.std == pytest.approx(66, rel=0.1)
    assert s.history_at_query.min >= 556 and s.history_at_query.max <= 1135
    with pytest.raises(ConfigError):
        DLRMv3Config(scale=0.0)


def write_ratings(path: Path) -> None:
    rows = ["user_id,movie_id,rating,timestamp,seq_pos"]
    rows += [f"1,{100 + k},4,{1000 + 10 * k},{k}" for k in range(20)]
    rows += [f"2,{500 + k},3,{2000 + k},{k}" for k in range(5)]
    rows += [f"3000,{100 + 2 * k},5,,{k}" for k in range(16)]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(rows) + "\n")


def test_ml1m_reader_and_replay(tmp_path: Path) -> None:
    path = tmp_path / "ratings_ordered.csv.gz"
    write_ratings(path)
    histories, num_items = read_ml1m(path)
    movies = sorted({100 + k for k in range(20)} | {500 + k for k in range(5)}
                    | {100 + 2 * k for k in range(16)})
    assert num_items == len(movies)
    dense = {m: i + 1 for i, m in enumerate(movies)}
    assert histories[1].items.tolist() == [dense[100 + k] for k in range(20)]
    assert histories[1].timestamps is not None and histories[3000].timestamps is None

    cfg = ML1MConfig(path=path, visits_per_user=2, events_per_visit=4, min_prefix_tokens=8,
                     num_candidates=16)
    workload = ML1MWorkload(cfg, seed=0).build(10.0, 4)
    assert sorted(workload.histories) == [1, 3000]  # user 2 is too short
    assert workload.histories[1].items.tolist() == [dense[100 + k] for k in range(12)]
    visits = [r for r in workload.requests if r.user_id == 1]
    assert [list(r.recent_items) for r in visits] == [
        [dense[100 + k] for k in range(12, 16)], [dense[100 + k] for k in range(16, 20)]]
    assert [r.request_ts for r in visits] == [1150, 1190]
    assert all(r.request_ts is None for r in workload.requests if r.user_id == 3000)
    assert_consistent(workload)
    timed = ML1MWorkload(ML1MConfig(path=path, visits_per_user=2, events_per_visit=4,
                                    min_prefix_tokens=8, timed_only=True), seed=0)
    assert timed.population.eligible.tolist() == [1]
    with pytest.raises(ConfigError):
        read_ml1m(tmp_path / "missing.csv.gz")


@pytest.mark.skipif(not DEFAULT_PATH.is_file(), reason="shared ML-1M copy not present")
def test_ml1m_real_file() -> None:
    histories, num_items = read_ml1m(DEFAULT_PATH)
    assert len(histories) == 6040 and num_items == 3706
    assert sum(len(h) for h in histories.values()) == 1_000_209
    assert histories[1].timestamps is not None and histories[3000].timestamps is None
    workload = workload_builder("ml1m", {}, seed=0).build(20.0, 400)
    assert_consistent(workload)
    assert len(workload.histories) == 100  # 4 visits per user


def test_unknown_source() -> None:
    with pytest.raises(ConfigError):
        workload_builder("criteo")
