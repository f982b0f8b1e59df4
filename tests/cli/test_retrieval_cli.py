"""``relaygr train-retrieval`` and ``eval-retrieval`` end to end on a tiny generated pair."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from relaygr.cascade.trained_retrieval import RankerCatalogue, TrainedRetrieval
from relaygr.cli.main import main
from relaygr.errors import ConfigError
from tests.retrieval.conftest import write_pair

FAST = ["--set", "dim=8", "--set", "max_epochs=2", "--set", "batch_size=128",
        "--set", "pool_size=8", "--set", "inter_negatives=4", "--set", "num_negatives=32"]


def test_train_then_eval_with_a_baseline(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    data = write_pair(tmp_path / "data", items=(150, 120))
    common = ["--pair", "aa_bb", "--data-dir", str(data), "--no-progress", "--seeds", "0", "1"]
    assert main(["train-retrieval", *common, "--out", str(tmp_path / "m"), *FAST]) == 0
    assert main(["train-retrieval", *common, "--out", str(tmp_path / "s"), "--preset", "single",
                 *FAST]) == 0
    out = tmp_path / "r.json"
    assert main(["eval-retrieval", "--checkpoint", str(tmp_path / "m"), "--protocol", "cvgae",
                 "--json", str(out), "--baseline", f"single={tmp_path / 's'}"]) == 0
    report = json.loads(out.read_text())
    assert report["protocol"] == "cvgae" and report["seeds"] == [0, 1]
    assert set(report["model"]) == {"aa", "bb"}
    assert set(report["baselines"]) == {"popularity", "itemcf", "single"}
    assert set(report["fused"]) == {"model+itemcf"} and set(report["fusion_weights"]) == {"0", "1"}
    for metrics in (report["model"]["aa"], report["baselines"]["popularity"]["bb"],
                    report["baselines"]["itemcf"]["aa"], report["fused"]["model+itemcf"]["bb"]):
        assert set(metrics) == {"hr@10", "ndcg@10", "hr@10_std", "ndcg@10_std"}
        assert 0.0 <= metrics["ndcg@10"] <= metrics["hr@10"] <= 1.0
    assert (tmp_path / "m" / "seed-1" / "split" / "bb.npz").is_file()
    # the cvgae run cannot answer the disencdr protocol (its 999 negatives); full takes either
    assert main(["eval-retrieval", "--checkpoint", str(tmp_path / "m"),
                 "--protocol", "disencdr"]) == 2
    assert "disencdr" in capsys.readouterr().err
    full = tmp_path / "full.json"
    assert main(["eval-retrieval", "--checkpoint", str(tmp_path / "m"), "--protocol", "full",
                 "--json", str(full)]) == 0
    hits = json.loads(full.read_text())["model"]["aa"]
    assert hits["hit@50"] <= hits["hit@100"] <= hits["hit@200"]
    # a baseline holding only some of the model's seeds would be averaged over others
    assert main(["train-retrieval", *common[:-2], "0", "--out", str(tmp_path / "s0"),
                 "--preset", "single", *FAST]) == 0
    capsys.readouterr()
    assert main(["eval-retrieval", "--checkpoint", str(tmp_path / "m"), "--protocol", "cvgae",
                 "--baseline", f"single={tmp_path / 's0'}"]) == 2
    assert "lacks seed(s) [1] of the model's run" in capsys.readouterr().err


def test_add_seeds_extends_a_run_as_if_trained_at_once(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    data = write_pair(tmp_path / "data", items=(150, 120))
    common = ["train-retrieval", "--pair", "aa_bb", "--data-dir", str(data), "--no-progress",
              *FAST]
    assert main([*common, "--out", str(tmp_path / "once"), "--seeds", "0", "1"]) == 0
    grown = tmp_path / "grown"
    assert main([*common, "--out", str(grown), "--seeds", "0"]) == 0
    assert main([*common, "--out", str(grown), "--seeds", "1", "--add-seeds"]) == 0
    assert json.loads((grown / "run.json").read_text())["seeds"] == [0, 1]
    reports = {}
    for name in ("once", "grown"):
        out = tmp_path / f"{name}.json"
        assert main(["eval-retrieval", "--checkpoint", str(tmp_path / name), "--protocol",
                     "cvgae", "--json", str(out)]) == 0
        reports[name] = json.loads(out.read_text())
    assert reports["grown"]["seeds"] == [0, 1]
    assert reports["grown"]["per_seed"] == reports["once"]["per_seed"]
    # a seed the run holds is not trained again; another config is refused; run.json as it was
    capsys.readouterr()
    before = (grown / "seed-1" / "model.safetensors").stat().st_mtime_ns
    assert main([*common, "--out", str(grown), "--seeds", "1", "--add-seeds"]) == 0
    assert "seed(s) [1] already finished" in capsys.readouterr().out
    assert (grown / "seed-1" / "model.safetensors").stat().st_mtime_ns == before
    assert main([*common, "--out", str(grown), "--seeds", "2", "--add-seeds",
                 "--set", "temperature=0.3"]) == 2
    assert "another config than this training (temperature: 0.6 there)" in \
        capsys.readouterr().err
    assert json.loads((grown / "run.json").read_text())["seeds"] == [0, 1]
    # the same files under another path are the same data (the digests decide)
    link = tmp_path / "same-data"
    link.symlink_to(data)
    moved = [a if a != str(data) else str(link) for a in common]
    assert main([*moved, "--out", str(grown), "--seeds", "2", "--add-seeds"]) == 0
    assert json.loads((grown / "run.json").read_text())["seeds"] == [0, 1, 2]


def test_an_interrupted_training_leaves_the_run_usable_and_is_finished_by_running_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """run.json lists only the seeds that finished: a command stopped inside a seed leaves the
    run as it was (its finished seeds evaluate), the same command with --add-seeds finishes it,
    and a new training into a run directory without --add-seeds is refused, not mixed in."""
    data = write_pair(tmp_path / "data", items=(150, 120))
    common = ["train-retrieval", "--pair", "aa_bb", "--data-dir", str(data), "--no-progress",
              *FAST]
    run = tmp_path / "run"
    assert main([*common, "--out", str(run), "--seeds", "0"]) == 0

    from relaygr.retrieval.trainer import RetrievalTrainer
    real_fit = RetrievalTrainer.fit

    def interrupted(self: RetrievalTrainer) -> object:
        raise KeyboardInterrupt             # the user stops the command inside seed 1

    monkeypatch.setattr(RetrievalTrainer, "fit", interrupted)
    assert main([*common, "--out", str(run), "--seeds", "1", "--add-seeds"]) == 130
    monkeypatch.setattr(RetrievalTrainer, "fit", real_fit)
    assert (run / "seed-1" / "split").is_dir()                  # started, not finished
    assert json.loads((run / "run.json").read_text())["seeds"] == [0]
    assert main(["eval-retrieval", "--checkpoint", str(run), "--protocol", "cvgae"]) == 0
    capsys.readouterr()
    # another training into the directory, without --add-seeds: refused, the run unchanged
    assert main([*common, "--out", str(run), "--seeds", "1", "--set", "temperature=0.3"]) == 2
    assert "already holds a retrieval run (seeds [0]); pass --add-seeds to train" in \
        capsys.readouterr().err
    # the interrupted command's seeds again, with --add-seeds: the finished one is skipped
    assert main([*common, "--out", str(run), "--seeds", "0", "1", "--add-seeds"]) == 0
    assert "seed(s) [0] already finished" in capsys.readouterr().out
    assert json.loads((run / "run.json").read_text())["seeds"] == [0, 1]
    # a run.json that lists a seed which never finished (written by an older relaygr): that
    # seed is refused by name when loaded, and may be trained again
    (run / "seed-1" / "result.json").unlink()
    capsys.readouterr()
    assert main(["eval-retrieval", "--checkpoint", str(run), "--protocol", "cvgae"]) == 2
    assert "seed 1 of" in capsys.readouterr().err
    assert main([*common, "--out", str(run), "--seeds", "1", "--add-seeds"]) == 0
    assert json.loads((run / "run.json").read_text())["seeds"] == [0, 1]


def test_reserved_names_partner_reading_runs_behind_a_ranker_and_mixed_run_dirs_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_pair(tmp_path / "data", items=(150, 120))
    run = tmp_path / "bridged"
    assert main(["train-retrieval", "--pair", "aa_bb", "--data-dir", str(data), "--no-progress",
                 "--seeds", "0", "--out", str(run), *FAST, "--set", "bridges=true",
                 "--set", "bridge_jaccard=0.3"]) == 0
    # a run named like a row every report has would overwrite it
    assert main(["eval-retrieval", "--checkpoint", str(run), "--protocol", "cvgae",
                 "--baseline", f"itemcf={run}"]) == 2
    assert "the report's own rows" in capsys.readouterr().err
    # served, the tower would read one domain's events only: not the vectors it was evaluated with
    with pytest.raises(ConfigError, match="partner-domain items"):
        TrainedRetrieval.load(run, RankerCatalogue("aa_bb", np.arange(1, 151)), 8, recency=1.0)
    # a ranking run and a retrieval run do not share a directory: each command refuses the other
    assert main(["train", "--dataset", "ml-1m", "--data-dir", str(data), "--out", str(run)]) == 2
    assert "holds a retrieval run" in capsys.readouterr().err
    ranker = tmp_path / "ranker"
    ranker.mkdir()
    (ranker / "config.json").write_text("{}")
    assert main(["train-retrieval", "--pair", "aa_bb", "--data-dir", str(data), "--no-progress",
                 "--seeds", "0", "--out", str(ranker), *FAST]) == 2
    assert "holds a ranking run" in capsys.readouterr().err
    assert not (ranker / "run.json").exists()
