"""``relaygr config show``: the configuration a command would run with, without running it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relaygr.cli.main import main
from relaygr.train import preset


def _show(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["config", "show", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_train_shows_the_preset_with_its_overrides(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    shown = _show(capsys, "train", "--dataset", "ml-1m", "--data-dir", str(tmp_path),
                  "--out", str(tmp_path / "run"), "--preset", "paper", "--set", "max_epochs=50")
    assert shown["command"] == "train"
    train = shown["config"]["train"]
    assert train["max_epochs"] == 50                                   # the override
    assert train["learning_rate"] == preset("paper").learning_rate     # the preset
    assert train["time_budget_s"] == preset("paper").time_budget_s     # finite: a number
    assert shown["config"]["preset"] == "paper" and shown["config"]["seed"] == 0
    assert not (tmp_path / "run").exists()                             # nothing ran


def test_serve_shows_the_validated_options(capsys: pytest.CaptureFixture[str]) -> None:
    shown = _show(capsys, "serve", "--instances", "2", "--slo-ms", "80", "--device", "cpu")
    system = shown["config"]["system"]
    assert (system["num_instances"], system["slo_ms"], system["devices"]) == (2, 80.0, ["cpu"])
    assert shown["config"]["size_budgets"] is True


def test_a_command_without_a_config_shows_its_flags_and_bad_input_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    shown = _show(capsys, "profile", "--size", "tiny", "--lengths", "256,512")
    assert shown["config"]["size"] == "tiny" and shown["config"]["lengths"] == [256, 512]
    assert main(["config", "show", "no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert main(["config", "show", "train", "--preset", "paper", "--set", "no_field=1",
                 "--dataset", "ml-1m", "--data-dir", ".", "--out", "x"]) == 2


def test_bench_shows_its_plan_without_measuring(capsys: pytest.CaptureFixture[str]) -> None:
    shown = _show(capsys, "bench", "--quick", "--device", "cpu", "--slo-ms", "40",
                  "--instances", "3")["config"]
    assert shown["modes"] == ["baseline", "reactive", "relay"]
    assert shown["system"]["num_instances"] == 3 and shown["system"]["slo_ms"] == 40.0
    assert shown["plan"]["slo_ms"] == 40.0
    assert shown["plan"]["serving"]["instances"] == 3
