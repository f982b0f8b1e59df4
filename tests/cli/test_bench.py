"""``relaygr bench``: the plan it measures, and (slow) the quick run end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from relaygr.bench.decision import P99Rule
from relaygr.bench.plans import QUICK_LOAD_SCALE, QUICK_MODES, run_plan
from relaygr.bench.profiles import PROFILES, profile_named
from relaygr.bench.verdict import EXACTNESS_TARGET
from relaygr.cli.main import main
from relaygr.errors import ConfigError
from relaygr.model import HSTUConfig


def test_plans_measure_every_phase_within_their_budgets() -> None:
    profile = profile_named("cpu")
    size: dict[str, Any] = profile.model_size       # dim, num_layers, num_heads: ints
    model = HSTUConfig(num_items=profile.num_items, **size)
    full = run_plan(profile, False, 50.0, 0, "cpu", model)
    quick = run_plan(profile, True, 50.0, 0, "cpu", model)
    assert full.sweep is not None and quick.sweep is not None
    assert full.sweep.lengths == profile.sweep_lengths
    assert set(quick.sweep.lengths) < set(full.sweep.lengths)
    # every point may take enough requests to pass at its plan's confidence (the sequential
    # rule for its size, anywhere from the fewest a point takes to the most), and the quick
    # run's points are the shorter
    for plan in (full, quick):
        budget = plan.budget
        assert budget.min_measured_requests <= budget.measured_requests
        for requests in (budget.min_measured_requests, budget.measured_requests):
            rule = P99Rule(budget.confidence).sequential(requests)
            assert rule.min_samples_to_pass() <= requests
    assert full.budget.confidence == 0.99 > quick.budget.confidence
    assert quick.budget.measured_requests < full.budget.min_measured_requests
    # the full sweep starts at the third length; modes without a length bar sweep every other
    # length
    assert full.sweep.start == profile.sweep_lengths[2]
    assert quick.sweep.start == quick.sweep.lengths[1]
    assert full.sweep.grid("relay") == full.sweep.grid("baseline") == profile.sweep_lengths
    for coarse in ("reactive", "relay-no-expander"):
        assert full.sweep.grid(coarse) == profile.sweep_lengths[::2]
    assert full.throughput is not None and quick.throughput is not None
    search = full.throughput.search
    assert (search.start_qps, search.min_qps) == (2 * profile.search_start_qps,
                                                  profile.search_start_qps / 2)
    # the quick run sweeps and searches at one load, where a pass takes seconds, not minutes
    quick_search = quick.throughput.search
    assert quick_search.start_qps == quick.sweep.qps == QUICK_LOAD_SCALE * profile.sweep_qps
    assert quick_search.min_qps == quick_search.start_qps / 4
    assert quick.mixed is not None and quick.mixed.search is None
    assert [w.name for w in full.workloads] == ["ml1m", "dlrmv3"]
    assert "relay-closed" in full.workloads[1].modes and quick.workloads == ()
    assert full.limit is not None and full.limit.prefix_len == profile.limit_prefix_len
    # both plans compare throughput at this machine's operating point, found on a cost curve
    # up to the grid's longest length; the quick run replays at least 50 requests for exactness
    for plan in (full, quick):
        assert plan.throughput is not None and plan.throughput.prefix_len is None
        assert plan.throughput.slo_share == 0.5
        assert plan.throughput.lengths.max_tokens == profile.sweep_lengths[-1]
        assert plan.exactness is not None and plan.exactness.requests >= 50
    # the two modes of the headline ratios first: a phase the deadline cuts after two points
    # has measured both; the quick run sweeps only those two (their bar is on length), both
    # plans narrow only their sweeps past the grid
    assert QUICK_MODES == ("baseline", "relay", "reactive")
    assert quick.sweep is not None and full.sweep is not None
    assert quick.sweep.swept(QUICK_MODES) == ("baseline", "relay")
    assert full.sweep.swept(QUICK_MODES) == QUICK_MODES
    for mode in ("reactive", "relay-no-trigger"):
        assert full.sweep.search(mode).rel_tol is None
    for plan in (quick, full):
        assert plan.sweep is not None
        assert all(plan.sweep.search(m).rel_tol for m in ("baseline", "relay"))
    for name in PROFILES:
        assert profile_named(name).name == name
    with pytest.raises(ConfigError):
        profile_named("tpu")


@pytest.mark.slow
def test_quick_bench_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    for key in ("slo_ms", "device", "model", "workload", "modes", "ratios", "limit",
                "exactness"):
        assert key in data
    assert set(data["modes"]) == set(QUICK_MODES)
    for mode in data["modes"].values():
        for key in ("max_seq_len_under_slo", "slo_throughput_qps", "p99_ms", "hit_rate_device",
                    "hit_rate_host"):
            assert key in mode
    for key in ("relay_vs_baseline_seq_len", "relay_vs_baseline_throughput",
                "relay_vs_reactive_throughput"):
        assert key in data["ratios"]
    for key in ("cached_rank_ms_isolated", "relay_overhead_ratio", "matmul_peak_gflops"):
        assert data["limit"][key] is not None
    assert data["exactness"]["requests_compared"] > 0
    assert data["exactness"]["max_abs_score_diff"] <= EXACTNESS_TARGET  # the product's claim
    assert data["modes"]["baseline"]["hit_rate_device"] == 0.0
    assert {p.name for p in out.glob("*.png")} == {"p99_vs_prefix_len.png", "p99_vs_qps.png",
                                                   "hit_rates.png"}
