"""``relaygr train`` and ``relaygr eval`` end to end on a generated dataset."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from relaygr.cli import eval as eval_cli
from relaygr.cli import train as train_cli
from relaygr.data import IdMap, load_sequences
from relaygr.errors import ConfigError, DataError, DataFormatError
from relaygr.train import preset
from relaygr.train.stage_runs import load_stage_run
from tests.train.helpers import (
    BACK_POSITION,
    MS_STAMP,
    TINY,
    write_cyclic_udata,
    write_interactions,
    write_untrained_run,
)

TINY_SETTINGS = ["dim=16", "num_layers=1", "num_heads=2", "max_seq_len=24", "batch_size=16",
                 "num_negatives=16", "rank_users=4", "rank_negatives=7", "max_epochs=2",
                 "dropout=0.0", "rank_hard_negatives=4", "rank_mine_k=40"]


def _run(argv: list[str]) -> int:
    # the lead registers these in relaygr.cli.main.COMMANDS; here they run on their own parser
    parser = argparse.ArgumentParser(prog="relaygr")
    sub = parser.add_subparsers(dest="command", required=True)
    train_cli.register(sub)
    eval_cli.register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_train_then_eval_writes_a_run_and_a_report(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    write_cyclic_udata(tmp_path / "u.data", num_users=40)
    run_dir = tmp_path / "run"
    settings = [arg for s in TINY_SETTINGS for arg in ("--set", s)]
    assert _run(["train", "--dataset", "ml-100k", "--data-dir", str(tmp_path), "--out",
                 str(run_dir), "--preset", "quick", "--no-progress", *settings]) == 0
    out = capsys.readouterr().out
    assert "40 users" in out and "test (retrieval head" in out
    assert "ranking phase, epoch 3" in out         # the quick preset's ranking phase ran
    for name in ("config.json", "model.safetensors", "id_map.json", "metrics.jsonl",
                 "last/state.safetensors", "last/progress.json"):
        assert (run_dir / name).is_file(), name
    config = json.loads((run_dir / "config.json").read_text())
    assert config["preset"] == "quick" and config["train"]["dim"] == 16
    assert config["dataset"]["num_users"] == 40
    report_path = tmp_path / "eval.json"
    assert _run(["eval", "--checkpoint", str(run_dir), "--dataset", "ml-100k", "--data-dir",
                 str(tmp_path), "--json", str(report_path), "--no-progress"]) == 0
    report = json.loads(report_path.read_text())
    assert set(report["heads"]) == {"retrieval", "ranking", "cascade", "stage", "popularity"}
    assert report["num_cases"] == 40 and report["split"] == "test"
    stage = report["retrieval_stage"]
    assert (stage["name"], stage["k"]) == ("head", 200)
    # the cascade finds no more than retrieval proposed, which is at most what retrieval ranks
    # in its top 200 (the stage never proposes a seen item; this data repeats some)
    heads = report["heads"]
    assert heads["cascade"]["hr@50"] <= stage["recall@200"] <= heads["retrieval"]["hr@200"]
    subset_path = tmp_path / "subset.json"
    assert _run(["eval", "--checkpoint", str(run_dir), "--dataset", "ml-100k", "--data-dir",
                 str(tmp_path), "--json", str(subset_path), "--no-progress", "--users", "10",
                 "--retrieve-k", "30", "--heads", "retrieval,cascade", "--split", "valid"]) == 0
    subset = json.loads(subset_path.read_text())
    assert subset["num_cases"] == 10 and subset["users_subset"] == 10
    assert set(subset["heads"]) == {"retrieval", "cascade", "stage", "popularity"}
    assert set(subset["retrieval_stage"]) == {"name", "k", "stage_weight", "recall@30",
                                           "cascade_minus_stage"}
    assert set(subset["retrieval_stage"]["cascade_minus_stage"]) == {"hr@10", "ndcg@10"}
    # a run directory as the retrieval stage: the same run's own head, read from disk, proposes
    # what --retrieval head proposes (its prefill of the same histories)
    other_path = tmp_path / "other.json"
    assert _run(["eval", "--checkpoint", str(run_dir), "--dataset", "ml-100k", "--data-dir",
                 str(tmp_path), "--json", str(other_path), "--no-progress", "--heads",
                 "cascade", "--retrieval", str(run_dir)]) == 0
    other = json.loads(other_path.read_text())
    assert other["retrieval_stage"]["recall@200"] == stage["recall@200"]
    assert other["heads"]["cascade"]["hr@10"] == pytest.approx(heads["cascade"]["hr@10"])
    # the stage's score as an input of the ranking: its weight chosen on the validation users
    fused_path = tmp_path / "fused.json"
    assert _run(["eval", "--checkpoint", str(run_dir), "--dataset", "ml-100k", "--data-dir",
                 str(tmp_path), "--json", str(fused_path), "--no-progress", "--heads",
                 "cascade", "--retrieval", str(run_dir), "--fit-stage-weight"]) == 0
    fused = json.loads(fused_path.read_text())["retrieval_stage"]
    assert fused["stage_weight"] == fused["stage_weight_fit"]["chosen"]
    assert set(fused["stage_weight_fit"]["grid"]) == {"0.0", "0.25", "0.5", "0.75", "1.0",
                                                      "1.5", "2.0", "3.0"}
    printed = capsys.readouterr().out
    assert "chosen" in printed and "popularity" in printed
    with pytest.raises(ConfigError, match="report it on --split test"):
        _run(["eval", "--checkpoint", str(run_dir), "--dataset", "ml-100k", "--data-dir",
              str(tmp_path), "--no-progress", "--split", "valid", "--fit-stage-weight"])
    with pytest.raises(ConfigError, match="neither a stage"):
        _run(["eval", "--checkpoint", str(run_dir), "--dataset", "ml-100k", "--data-dir",
              str(tmp_path), "--no-progress", "--retrieval", str(tmp_path / "missing")])
    for metrics in report["heads"].values():
        assert set(metrics) == {"hr@10", "hr@50", "hr@200", "ndcg@10", "ndcg@50", "ndcg@200",
                                "mrr", "num_cases"}
        assert 0.0 <= metrics["ndcg@10"] <= metrics["hr@10"] <= metrics["hr@50"] <= 1.0


def test_bad_input_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "u.data").write_text("1\t2\t3\t4\n1\t2\t3\n")
    with pytest.raises(DataFormatError, match=r"u\.data:2:"):
        _run(["train", "--dataset", "ml-100k", "--data-dir", str(tmp_path), "--out",
              str(tmp_path / "run")])
    with pytest.raises(ConfigError, match="unknown TrainConfig keys"):
        _run(["train", "--dataset", "ml-100k", "--data-dir", str(tmp_path), "--out",
              str(tmp_path / "run"), "--set", "colour=3"])
    with pytest.raises(ConfigError, match="key=value"):
        train_cli.parse_overrides(["dim"])
    assert train_cli.parse_overrides(["dim=8", "similarity=dot"]) == {"dim": 8,
                                                                     "similarity": "dot"}


def test_a_stage_run_must_share_items_positions_and_held_out_users(tmp_path: Path) -> None:
    """What ``--stage`` (train) and ``--retrieval RUN`` (eval) refuse, in one place."""
    write_cyclic_udata(tmp_path / "u.data", num_users=40)
    settings = [arg for s in TINY_SETTINGS for arg in ("--set", s)]
    base = ["train", "--dataset", "ml-100k", "--data-dir", str(tmp_path), "--preset", "quick",
            "--no-progress", *settings, "--set", "rank_phase_epochs=0"]
    assert _run([*base, "--out", str(tmp_path / "stage")]) == 0
    assert _run([*base, "--out", str(tmp_path / "timed"), "--set", "use_timestamps=true"]) == 0
    seqs = load_sequences("ml-100k", tmp_path)
    config = preset("quick").with_(**train_cli.parse_overrides(TINY_SETTINGS))
    stage = load_stage_run(tmp_path / "stage", "cpu", seqs.id_map, config)
    assert stage.run.train.valid_seed == config.valid_seed
    with pytest.raises(ConfigError, match="numbers items differently"):
        other = IdMap((*seqs.id_map.items[:-1], 10**6))
        load_stage_run(tmp_path / "stage", "cpu", other, config)
    with pytest.raises(ConfigError, match="must be position-only"):
        load_stage_run(tmp_path / "timed", "cpu", seqs.id_map, config)
    with pytest.raises(ConfigError, match="held out other validation users"):
        load_stage_run(tmp_path / "stage", "cpu", seqs.id_map,
                                 config.with_(valid_seed=7))
    # without a choice made on the validation users, other held-out users are fine
    load_stage_run(tmp_path / "stage", "cpu", seqs.id_map, None)


def test_eval_of_a_model_that_reads_time_checks_the_data_as_training_and_serving_do(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A timed model is evaluated only on data it could have been trained on and served:
    every user timed, in unix seconds within the API's 0..2^40, in its sequence's order
    (data.servable), with the errors training and serve give; a position-only one reads no
    time and evaluates on any of it."""
    users = list(range(1, 25))
    good = write_interactions(tmp_path / "good" / "interactions.csv", users)
    seqs = load_sequences("table", good)
    timed = write_untrained_run(tmp_path / "timed", seqs, TINY.with_(use_timestamps=True),
                                dataset="table")
    untimed = write_untrained_run(tmp_path / "untimed", seqs, dataset="table")
    back = write_interactions(tmp_path / "back" / "interactions.csv", users, back=7)
    millis = write_interactions(tmp_path / "ms" / "interactions.csv", users, milliseconds=9)
    partly = tmp_path / "partly" / "interactions.csv"
    partly.parent.mkdir()
    rows = good.read_text().splitlines()
    rows[3] = ",".join(v if k != 2 else "" for k, v in enumerate(rows[3].split(",")))
    partly.write_text("\n".join(rows) + "\n")

    def evaluate(run: Path, data: Path) -> int:
        return _run(["eval", "--checkpoint", str(run), "--dataset", "table", "--data-dir",
                     str(data), "--heads", "ranking", "--no-progress"])

    line = 2 + 6 * 10 + BACK_POSITION
    with pytest.raises(DataError, match=rf"^{re.escape(str(back))}:{line}: user 7's event at "
                       rf"position {BACK_POSITION} \(0-based\) of its sequence"):
        evaluate(timed, back)
    with pytest.raises(DataError, match=rf"^{re.escape(str(millis))}:{2 + 8 * 10}: user 9 has "
                       rf"timestamp {MS_STAMP}, outside the 0\.\.2\^40 unix seconds"):
        evaluate(timed, millis)
    with pytest.raises(ConfigError, match=r"reads time .* 1 users of .*partly.* have an event "
                       "without a timestamp"):
        evaluate(timed, partly)
    capsys.readouterr()
    assert evaluate(timed, good) == 0
    for data in (back, millis, partly):
        assert evaluate(untimed, data) == 0


def test_a_stage_weight_is_not_chosen_on_validation_targets_the_stage_trained_on(
        tmp_path: Path) -> None:
    """A stage run of the same validation settings on other data (the same log with one more
    user) draws other validation users: some of the ranker's validation targets are the stage's
    training. --fit-stage-weight measures that and refuses to choose on them."""
    (tmp_path / "full").mkdir()
    full = write_cyclic_udata(tmp_path / "full" / "u.data", num_users=40)
    seqs = load_sequences("ml-100k", full)
    cfg = TINY.with_(valid_users=10, valid_seed=3)
    stage = write_untrained_run(tmp_path / "stage", seqs, cfg)        # trained on every user
    ranker_data = tmp_path / "ranker-data"                            # the same without user 40
    ranker_data.mkdir()
    (ranker_data / "u.data").write_text("".join(
        line for line in full.read_text().splitlines(keepends=True)
        if int(line.split("\t")[0]) != 40))
    ranker_seqs = load_sequences("ml-100k", ranker_data, id_map=seqs.id_map)
    ranker = write_untrained_run(tmp_path / "ranker", ranker_seqs, cfg)
    with pytest.raises(ConfigError, match=r"the stage trained on \d+\.\d% of the validation"):
        _run(["eval", "--checkpoint", str(ranker), "--dataset", "ml-100k", "--data-dir",
              str(ranker_data), "--no-progress", "--heads", "cascade", "--retrieval",
              str(stage), "--fit-stage-weight"])


def test_a_ranker_is_not_trained_against_a_stage_that_trained_on_its_validation_targets(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``train --stage``: a stage run of the same validation settings on other data (the same
    log with a copy of user 1 as one more user) draws other validation users, so it trained on
    some of the ranker's validation targets, which its hard negatives and the ranking phase's
    head would be chosen on: refused, measured as eval --fit-stage-weight measures it. Where the
    stage's data cannot be read, a warning says so and training goes on."""
    (tmp_path / "ranker-data").mkdir()
    data = write_cyclic_udata(tmp_path / "ranker-data" / "u.data", num_users=64)
    lines = data.read_text().splitlines(keepends=True)
    (tmp_path / "stage-data").mkdir()
    (tmp_path / "stage-data" / "u.data").write_text("".join(
        lines + [line.replace("1\t", "999\t", 1) for line in lines
                 if line.split("\t")[0] == "1"]))
    settings = [*TINY_SETTINGS, "valid_users=20", "valid_seed=0", "max_epochs=1",
                "rank_phase_epochs=0"]
    config = preset("quick").with_(**train_cli.parse_overrides(settings))
    write_untrained_run(tmp_path / "stage", load_sequences("ml-100k", tmp_path / "stage-data"),
                        config)
    train = ["train", "--dataset", "ml-100k", "--data-dir", str(tmp_path / "ranker-data"),
             "--preset", "quick", "--no-progress", "--stage", str(tmp_path / "stage"),
             *[arg for s in settings for arg in ("--set", s)]]
    with pytest.raises(ConfigError, match=r"the stage trained on \d+\.\d% of the validation "
                       "targets the hard negatives and the ranking phase's head"):
        _run([*train, "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()
    (tmp_path / "stage-data" / "u.data").unlink()
    capsys.readouterr()
    assert _run([*train, "--out", str(tmp_path / "unverified")]) == 0
    assert "warning: what the stage trained on of the validation targets could not be " \
        "measured" in capsys.readouterr().out
