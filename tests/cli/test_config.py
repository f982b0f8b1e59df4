"""``relaygr config show``: the configuration a command would run with, without running it."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from relaygr.cascade.config import SystemConfig
from relaygr.cli.main import main
from relaygr.engine.scheduler import BatchPolicy
from relaygr.relay.trigger import TriggerConfig
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


def test_the_shown_system_is_a_system_config_file_serve_reads_back(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "system.json"
    path.write_text(json.dumps({"trigger": {"risk_fraction": 0.5},
                                "instance": {"batch": {"max_requests": 2}}}))
    shown = _show(capsys, "serve", "--system-config", str(path), "--stage-weight", "0.25",
                  "--device", "cpu")["config"]["system"]
    # nested as SystemConfig is: the file's parts and the flag, the rest their defaults
    assert shown["trigger"]["risk_fraction"] == 0.5
    assert shown["trigger"]["burst_tokens"] == TriggerConfig().burst_tokens
    assert shown["instance"]["batch"] == {"max_requests": 2, "max_tokens": BatchPolicy().max_tokens}
    assert shown["stages"]["stage_weight"] == 0.25
    assert set(shown) == {f.name for f in fields(SystemConfig)}
    again = tmp_path / "shown.json"
    again.write_text(json.dumps(shown))
    assert _show(capsys, "serve", "--system-config", str(again))["config"]["system"] == shown


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
    assert shown["modes"] == ["baseline", "relay", "reactive"]
    assert shown["plan"]["sweep"]["modes"] == ["baseline", "relay"]
    assert shown["system"]["num_instances"] == 3 and shown["system"]["slo_ms"] == 40.0
    assert shown["plan"]["slo_ms"] == 40.0
    assert shown["plan"]["serving"]["instances"] == 3


@pytest.mark.parametrize("command", [
    ["train", "--dataset", "ml-1m", "--data-dir", "x", "--threads", "0"],
    ["train-retrieval", "--pair", "a_b", "--data-dir", "x", "--out", "y", "--threads", "0"],
    ["eval-retrieval", "--checkpoint", "x", "--protocol", "cvgae", "--threads", "-1"],
    ["profile", "--threads", "0"],
    ["bench", "--quick", "--instances", "0"],
])
def test_a_thread_count_below_one_is_refused_not_ignored(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "show", *command])
    assert exit_info.value.code == 2
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_an_unreadable_system_config_is_a_config_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "system.json"
    broken.write_text('{"mode": ')
    for path in (tmp_path / "absent.json", broken, tmp_path):
        assert main(["config", "show", "serve", "--system-config", str(path)]) == 2
        assert f"--system-config {path}: cannot read it as JSON" in capsys.readouterr().err


def test_an_unwritable_json_path_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """eval, eval-retrieval, profile and bench check --json first, not after minutes (or an
    hour) of work."""
    for command in (["eval", "--dataset", "ml-1m", "--data-dir", str(tmp_path / "none")],
                    ["eval-retrieval", "--checkpoint", str(tmp_path / "none"),
                     "--protocol", "cvgae"],
                    ["profile", "--lengths", "64", "--candidates", "8"],
                    ["bench", "--quick", "--out", str(tmp_path / "out")]):
        assert main([*command, "--json", str(tmp_path)]) == 2
        assert f"--json {tmp_path} is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["bogus", "cuda:99"])
def test_a_device_this_machine_lacks_is_refused_when_parsed(
        device: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["serve"], ["profile"], ["train", "--dataset", "ml-1m", "--data-dir", "x"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["config", "show", *command, "--device", device])
        assert exit_info.value.code == 2
        assert device in capsys.readouterr().err


def test_flags_that_would_be_ignored_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A zero replica or instance count is not 'the default', --pair is not ignored beside
    --dataset ml-1m, and --fit-stage-weight needs the cascade head and no weight of its own."""
    for flag in ("--replicas", "--instances"):
        with pytest.raises(SystemExit):
            main(["config", "show", "serve", flag, "0"])
        assert "expected an integer >= 1" in capsys.readouterr().err
    assert main(["train-retrieval", "--dataset", "ml-1m", "--pair", "sport_cloth",
                 "--data-dir", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert "--pair names an Amazon pair" in capsys.readouterr().err
    for extra in (["--heads", "retrieval"], ["--stage-weight", "0.5"]):
        assert main(["eval", "--dataset", "ml-1m", "--data-dir", str(tmp_path),
                     "--fit-stage-weight", *extra]) == 2
        assert "--fit-stage-weight chooses the cascade's stage weight" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "says"), [
    (["--slo-ms", "0"], "expected a finite number > 0"),
    (["--slo-ms", "inf"], "expected a finite number > 0"),
    (["--slo-ms", "-5"], "expected a finite number > 0"),
    (["--seed", "-1"], "expected an integer >= 0"),
])
def test_bench_refuses_an_slo_or_seed_it_would_replace_or_fail_on_late(
        flags: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--slo-ms 0`` ran with the profile's SLO, ``inf`` passed every point, a negative seed
    failed in numpy after the model was built."""
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "show", "bench", "--quick", *flags])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_bench_refuses_a_mode_list_that_names_no_mode(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "bench", "--quick", "--modes", " , "]) == 2
    assert "names no mode" in capsys.readouterr().err
