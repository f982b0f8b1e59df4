"""Latency cost model: exact NNLS, recovery of known coefficients, monotonicity, JSON files."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.errors import ConfigError, InvalidInputError
from relaygr.model import HSTU, HSTUConfig
from relaygr.relay import (
    CostModelSource,
    FitGrid,
    LatencyCostModel,
    LatencySample,
    fit_on_model,
)
from relaygr.relay.costmodel import (
    CACHED_FEATURES,
    FULL_FEATURES,
    PREFILL_FEATURES,
    cached_features,
    full_features,
    prefill_features,
)
from relaygr.relay.fitting import LinearFit, nonnegative_lstsq

PREFILL_TRUE = np.array([1.5, 0.02, 4e-5])
FULL_TRUE = np.array([2.0, 0.03, 5e-5, 0.04, 1e-5])
CACHED_TRUE = np.array([0.7, 0.001, 0.025, 4e-5, 0.05, 2e-5])
SOURCE = CostModelSource("measured", "cpu", "float32", HSTUConfig(num_items=100))


def synthetic_samples(suffixes: tuple[int, ...] = (0, 32)) -> list[LatencySample]:
    samples = []
    for n, s, c in itertools.product((64, 256, 1024, 2048), suffixes, (16, 128)):
        samples.append(LatencySample(
            n, s, c,
            float(prefill_features(np.array(n), np.array(0)) @ PREFILL_TRUE),
            float(full_features(np.array(n), np.array(s), np.array(c)) @ FULL_TRUE),
            float(cached_features(np.array(n), np.array(s), np.array(c)) @ CACHED_TRUE)))
    return samples


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(3, 12), cols=st.integers(1, 5))
def test_nonnegative_lstsq_meets_the_optimality_conditions(seed: int, rows: int,
                                                           cols: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(rows, cols))
    b = rng.normal(size=rows)
    x = nonnegative_lstsq(a, b)
    grad = a.T @ (a @ x - b)
    scale = np.linalg.norm(a, axis=0) * (np.linalg.norm(b) + 1)
    assert np.all(x >= 0)
    assert np.all(np.abs(grad[x > 0]) <= 1e-8 * scale[x > 0])   # stationary on the support
    assert np.all(grad[x == 0] >= -1e-8 * scale[x == 0])         # no descent into x_i > 0


def test_fit_recovers_known_coefficients_when_the_suffix_varies() -> None:
    model = LatencyCostModel.fit(synthetic_samples(), SOURCE)
    np.testing.assert_allclose(model.prefill.coef_ms, PREFILL_TRUE, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(model.full.coef_ms, FULL_TRUE, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(model.cached.coef_ms, CACHED_TRUE, rtol=1e-6, atol=1e-12)
    assert model.full.max_rel_error < 1e-9 and model.full.num_points == 16
    assert model.full_rank_ms(1024, 32, 128) == pytest.approx(
        float(full_features(np.array(1024), np.array(32), np.array(128)) @ FULL_TRUE))


def test_without_suffix_points_the_suffix_terms_come_from_the_prefill_fit() -> None:
    model = LatencyCostModel.fit(synthetic_samples((0,)), SOURCE)
    coef = dict(zip(CACHED_FEATURES, model.cached.coef_ms, strict=True))
    assert coef["suffix_tokens"] == model.prefill.coef_ms[PREFILL_FEATURES.index("tokens")]
    assert coef["suffix_pairs"] == model.prefill.coef_ms[PREFILL_FEATURES.index("attn_pairs")]
    for name in ("const", "prefix_tokens", "candidates", "candidate_keys"):
        assert coef[name] == pytest.approx(CACHED_TRUE[CACHED_FEATURES.index(name)], rel=1e-6)


def test_negative_work_is_never_fitted() -> None:
    rng = np.random.default_rng(0)
    samples = [LatencySample(n, 0, c, 5.0 + rng.normal(), 10.0 - n * 1e-3 + c * 1e-2, 1.0)
               for n, c in itertools.product((64, 512, 2048), (8, 64))]
    model = LatencyCostModel.fit(samples, SOURCE)
    assert all(c >= 0 for fit in (model.prefill, model.full, model.cached) for c in fit.coef_ms)


@settings(max_examples=80, deadline=None)
@given(coef=st.lists(st.floats(0, 1), min_size=6, max_size=6),
       shape=st.tuples(st.integers(0, 4096), st.integers(0, 256), st.integers(0, 1024)),
       grow=st.tuples(st.integers(0, 512), st.integers(0, 64), st.integers(0, 256)))
def test_predictions_are_monotone_in_prefix_suffix_and_candidates(
        coef: list[float], shape: tuple[int, int, int], grow: tuple[int, int, int]) -> None:
    model = LatencyCostModel(LinearFit(PREFILL_FEATURES, tuple(coef[:3]), 0, 0, 1),
                             LinearFit(FULL_FEATURES, tuple(coef[:5]), 0, 0, 1),
                             LinearFit(CACHED_FEATURES, tuple(coef), 0, 0, 1), SOURCE)
    bigger = tuple(a + b for a, b in zip(shape, grow, strict=True))
    small_p, big_p = model.predict(*shape), model.predict(*bigger)
    assert big_p.full_rank_ms >= small_p.full_rank_ms
    assert big_p.cached_rank_ms >= small_p.cached_rank_ms
    assert big_p.prefill_ms >= small_p.prefill_ms
    assert model.prefill_ms(shape[1], shape[0] + grow[0]) >= model.prefill_ms(shape[1], shape[0])


def test_json_round_trip_is_exact(tmp_path: Path) -> None:
    model = LatencyCostModel.fit(synthetic_samples(), SOURCE)
    path = tmp_path / "cost.json"
    model.save(path)
    assert LatencyCostModel.load(path) == model
    data = json.loads(path.read_text())
    for part, key, value, says in (
            ("full", "feature_names", ["const", "tokens", "pairs", "candidates", "keys"],
             "LatencyCostModel.full fits the features"),
            ("full", "feature_names", ["const"], "LatencyCostModel.full: 1 features but 5"),
            ("full", "coef", [1.0], "unknown LatencyCostModel.full keys: ['coef']"),
            ("cached", "rmse_ms", "low", "LatencyCostModel.cached.rmse_ms: Input should be"),
            ("source", "model", {"dim": 8, "heads": 2}, "unknown LatencyCostModel.source.model "
                                                       "keys: ['heads']")):
        bad = json.loads(json.dumps(data))
        bad[part][key] = value
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError) as caught:
            LatencyCostModel.load(path)
        assert says in str(caught.value)
    path.write_text('{"format": "something else"}')
    with pytest.raises(ConfigError, match="format"):
        LatencyCostModel.load(path)
    with pytest.raises(ConfigError, match="cannot read"):
        LatencyCostModel.load(tmp_path / "missing.json")


def write_profile(path: Path, samples: list[LatencySample], **extra: object) -> None:
    points = [{"prefix_tokens": s.prefix_tokens, "candidates": s.candidates,
               "prefill_ms": s.prefill_ms, "full_rank_ms": s.full_rank_ms,
               "cached_rank_ms": s.cached_rank_ms, "flops": 1.0} for s in samples]
    data = {"device": "cpu", "dtype": "float32", "model": SOURCE.model.to_dict(),  # type: ignore
            "matmul_peak_gflops": 55.0, "points": points, **extra}
    path.write_text(json.dumps(data))


def test_profile_json_is_fitted_with_its_source(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_profile(path, synthetic_samples((0,)))
    model = LatencyCostModel.from_profile_json(path)
    assert model.source == CostModelSource("profile", "cpu", "float32", SOURCE.model)
    np.testing.assert_allclose(model.full.coef_ms, FULL_TRUE, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(model.prefill.coef_ms, PREFILL_TRUE, rtol=1e-6, atol=1e-12)


def test_malformed_profiles_are_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_profile(path, [])
    with pytest.raises(ConfigError, match="non-empty"):
        LatencyCostModel.from_profile_json(path)
    path.write_text(json.dumps({"device": "cpu", "dtype": "float32", "model": None,
                                "points": [{"prefix_tokens": 5}]}))
    with pytest.raises(ConfigError, match="point 0 needs"):
        LatencyCostModel.from_profile_json(path)
    path.write_text(json.dumps({"points": []}))
    with pytest.raises(ConfigError, match="lacks"):
        LatencyCostModel.from_profile_json(path)
    write_profile(path, synthetic_samples((0,))[:1])
    with pytest.raises(ConfigError, match="at least 2"):
        LatencyCostModel.from_profile_json(path)


def test_bad_shapes_are_input_errors() -> None:
    model = LatencyCostModel.fit(synthetic_samples(), SOURCE)
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidInputError):
            model.full_rank_ms(bad, 0, 1)  # type: ignore[arg-type]


def test_fit_on_a_tiny_model_measures_every_shape() -> None:
    torch.manual_seed(0)
    hstu = HSTU(HSTUConfig(num_items=200, dim=16, num_layers=1, num_heads=2,
                           max_seq_len=70)).eval()
    grid = FitGrid(prefix_tokens=(16, 64), suffix_tokens=(0, 8), candidates=(4, 16), repeats=1)
    model = fit_on_model(hstu, "cpu", grid)
    # Every shape but prefix 64 + suffix 8 (over max_seq_len 70): 2 x 2 + 1 x 2.
    assert model.full.num_points == model.cached.num_points == 6
    assert model.source == CostModelSource("measured", "cpu", "float32", hstu.cfg)
    assert all(c >= 0 for c in model.cached.coef_ms)
    assert model.full_rank_ms(64, 8, 16) >= model.full_rank_ms(16, 0, 4) > 0
    with pytest.raises(ConfigError, match="at least 2"):
        fit_on_model(hstu, "cpu", FitGrid(prefix_tokens=(70, 100), suffix_tokens=(16,),
                                          candidates=(4,), repeats=1))


def test_fit_on_a_next_time_model_computes_each_prefix_for_its_suffix() -> None:
    """A model whose time bias reads the next event's time (what ``relaygr serve`` fits on a
    trained ``time_query=next`` checkpoint at start-up) is timed on the same shapes."""
    torch.manual_seed(0)
    hstu = HSTU(HSTUConfig(num_items=200, dim=16, num_layers=2, num_heads=2, max_seq_len=70,
                           time_query="next")).eval()
    grid = FitGrid(prefix_tokens=(16, 32), suffix_tokens=(0, 8), candidates=(4,), repeats=1)
    assert fit_on_model(hstu, "cpu", grid).cached.num_points == 4


def test_the_json_of_relaygr_profile_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relaygr.bench import profile

    # The matmul peak only annotates the table; skip measuring it to keep the test fast.
    monkeypatch.setattr(profile, "matmul_peak_gflops", lambda device, dtype: 1.0)
    cfg = profile.ProfileConfig(size="tiny", prefix_lengths=(32, 64, 128),
                                candidate_counts=(4, 16), repeats=1)
    result = profile.run_profile(cfg)
    path = tmp_path / "profile.json"
    result.write_json(path)
    model = LatencyCostModel.from_profile_json(path)
    assert model.source.origin == "profile" and model.source.device == "cpu"
    assert model.source.model == HSTUConfig.from_dict(result.model)
    assert model.full.num_points == 6
    assert model.full_rank_ms(128, 0, 16) > 0 and all(c >= 0 for c in model.cached.coef_ms)
