"""The profile and demo commands run end to end on a tiny model and report real figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from relaygr.cli.main import main
from tests.tolerance import SCORE_TOL


def test_profile_writes_a_point_per_length_and_candidate_count(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture
                                                                ) -> None:
    out = tmp_path / "profile.json"
    code = main(["profile", "--size", "tiny", "--lengths", "16,48", "--candidates", "4,9",
                 "--repeats", "1", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["model"]["num_layers"] == 2 and data["model"]["dim"] == 32
    assert data["matmul_peak_gflops"] > 0
    points = {(p["prefix_tokens"], p["candidates"]): p for p in data["points"]}
    assert set(points) == {(16, 4), (16, 9), (48, 4), (48, 9)}
    for p in points.values():
        assert p["full_rank_ms"] > 0 and p["cached_rank_ms"] > 0 and p["prefill_ms"] > 0
        assert p["speedup"] == pytest.approx(p["full_rank_ms"] / p["cached_rank_ms"])
        # the physical limit: matmul FLOPs at the peak plus scores at the element-wise rate
        flops_ms = 1e3 * p["cached_rank_gflops"] * p["cached_rank_ms"] * 1e-3 \
            / data["matmul_peak_gflops"]
        assert p["cached_rank_limit_ms"] > flops_ms > 0
        assert p["full_rank_limit_ms"] > p["cached_rank_limit_ms"]
        # the work behind them, from model/flops.py: the cached pass does least of it
        for work in ("flops", "scores"):
            assert 0 < p[f"cached_rank_{work}"] < p[f"full_rank_{work}"]
            assert 0 < p[f"prefill_{work}"] < p[f"full_rank_{work}"]
    assert data["elementwise_gelems"] > 0
    assert data["attention"] == "eager"
    printed = capsys.readouterr().out
    assert "matmul peak" in printed and "% of limit" in printed


def test_profile_with_timestamps_and_the_fused_kernel_names_what_ran(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture
                                                                     ) -> None:
    out = tmp_path / "profile.json"
    assert main(["profile", "--size", "tiny", "--lengths", "80", "--candidates", "5",
                 "--repeats", "1", "--timestamps", "--set", "attention=fused",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["timestamps"] is True
    assert data["attention"] == "fused (torch.compile, inductor CPU)"
    assert "with timestamps" in capsys.readouterr().out


def test_profile_times_the_time_bias_in_alternation_and_reports_the_rounds_ratios(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "profile.json"
    assert main(["profile", "--size", "tiny", "--lengths", "24", "--candidates", "3",
                 "--suffix", "2", "--repeats", "1", "--time-bias-rounds", "3",
                 "--json", str(out)]) == 0
    costs = json.loads(out.read_text())["time_bias"]
    assert [(c["prefix_tokens"], c["candidates"], c["path"]) for c in costs] == [
        (24, 3, "prefill"), (24, 3, "full"), (24, 3, "cached")]
    for c in costs:
        assert c["rounds"] == 3 and c["plain_ms"] > 0 and c["timed_ms"] > 0
        # the median of three per-round ratios lies within their range
        assert 0 < c["ratio_min"] <= c["ratio"] <= c["ratio_max"]
    assert "the time bias's cost" in capsys.readouterr().out
    assert main(["profile", "--size", "tiny", "--lengths", "24", "--candidates", "3",
                 "--time-bias-rounds", "-1", "--json", str(out)]) == 2


def test_profile_takes_model_overrides_and_refuses_unknown_ones(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert main(["profile", "--size", "tiny", "--lengths", "64", "--candidates", "4",
                 "--repeats", "1", "--set", "query_block=32", "--set", "score_block_elems=4096",
                 "--json", str(out)]) == 0
    model = json.loads(out.read_text())["model"]
    assert (model["query_block"], model["score_block_elems"]) == (32, 4096)
    assert main(["profile", "--size", "tiny", "--set", "no_such_field=1"]) == 2


def test_demo_reports_latencies_and_exactness(capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--size", "tiny", "--prefix", "300", "--suffix", "5",
                 "--candidates", "20", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "ranking, relayed" in text and "ranking, full pass" in text
    diff = float(re.search(r"cached vs full: ([0-9.e+-]+)", text).group(1))  # type: ignore[union-attr]
    assert diff <= SCORE_TOL


def test_bad_arguments_exit_with_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--lengths", "0,5"])
    assert exc.value.code == 2


def test_ctrl_c_ends_a_command_with_130_and_one_line(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from relaygr.cli import profile

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(profile, "run", interrupted)
    assert main(["profile", "--size", "tiny"]) == 130
    assert capsys.readouterr().err.strip() == "relaygr profile: interrupted"


def test_profile_settings_that_measure_nothing_are_refused() -> None:
    from relaygr.bench.profile import ProfileConfig
    from relaygr.errors import ConfigError

    for bad in ({"repeats": 0}, {"suffix_tokens": -8}, {"prefix_lengths": ()},
                {"candidate_counts": (0,)}, {"time_bias_rounds": -1}):
        with pytest.raises(ConfigError):
            ProfileConfig(**bad)
