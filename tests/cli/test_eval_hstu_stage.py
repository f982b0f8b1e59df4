"""``relaygr eval --retrieval RUN`` with an HSTU run as the stage: the share of the evaluated
targets that run trained on, read from the data its run directory records, is measured,
printed and recorded, and a stage whose recorded data cannot be read is flagged, not trusted.

The runs are written untrained (``save_model``): what is checked depends on the data they record,
not on their weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from relaygr.cli.main import main
from relaygr.data import load_sequences
from tests.train.helpers import (
    TINY,
    write_cyclic_udata,
    write_tied_udata,
    write_truncated,
    write_untrained_run,
)


def _leaky_data(tmp_path: Path) -> tuple[Path, Path]:
    """``early``: every user's last two events removed from a generated log; ``mixed``: the
    odd users' whole log, the even users' as in ``early``. An HSTU run on ``mixed`` trains on
    all but each user's last two events: every event of an odd user in ``early``, its test
    target too; an even user's ``early`` test target it never saw."""
    full = write_cyclic_udata(tmp_path / "full.data", num_users=40)
    early = write_truncated(full, tmp_path / "early", lambda user: True)
    mixed = write_truncated(full, tmp_path / "mixed", lambda user: user % 2 == 0)
    # one catalogue: an HSTU stage must number items as the ranker does
    assert load_sequences("ml-100k", early).id_map == load_sequences("ml-100k", mixed).id_map
    return early, mixed


def _eval(tmp_path: Path, ranker: Path, data: Path, stage: Path, name: str) -> dict[str, Any]:
    report = tmp_path / f"{name}.json"
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-100k", "--data-dir",
                 str(data), "--retrieval", str(stage), "--retrieve-k", "20", "--heads",
                 "cascade", "--no-progress", "--json", str(report)]) == 0
    stage_report = json.loads(report.read_text())["retrieval_stage"]
    assert isinstance(stage_report, dict)
    return stage_report


def test_eval_measures_the_targets_an_hstu_stage_trained_on_from_its_recorded_data(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    early, mixed = _leaky_data(tmp_path)
    early_seqs = load_sequences("ml-100k", early)
    ranker = write_untrained_run(tmp_path / "ranker", early_seqs)
    leaky = write_untrained_run(tmp_path / "leaky", load_sequences("ml-100k", mixed), seed=1)
    clean = write_untrained_run(tmp_path / "clean", early_seqs, seed=1)
    capsys.readouterr()
    # the stage trained on the odd users' test targets: 20 of the 40
    reported = _eval(tmp_path, ranker, early, leaky, "leaky")
    assert reported["targets_in_run_training"] == 0.5
    assert reported["run_data_source"] == str(mixed / "u.data")
    printed = capsys.readouterr().out
    assert "warning: 50.0% of these targets are training interactions of the retrieval run" \
        in printed
    assert f"trained on {mixed / 'u.data'}" in printed
    # a stage trained on the evaluated data held every test target out
    reported = _eval(tmp_path, ranker, early, clean, "clean")
    assert reported["targets_in_run_training"] == 0.0
    assert reported["run_data_source"] == str(early / "u.data")
    assert "warning" not in capsys.readouterr().out


def test_eval_flags_an_hstu_stage_whose_recorded_data_cannot_be_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    early, mixed = _leaky_data(tmp_path)
    ranker = write_untrained_run(tmp_path / "ranker", load_sequences("ml-100k", early))
    stage = write_untrained_run(tmp_path / "stage", load_sequences("ml-100k", mixed), seed=1)
    (mixed / "u.data").unlink()
    capsys.readouterr()
    reported = _eval(tmp_path, ranker, early, stage, "unread")
    assert reported["targets_in_run_training"] is None
    assert reported["run_data_source"] == str(mixed / "u.data")
    assert "not readable here" in reported["run_data_unverified"]
    printed = capsys.readouterr().out
    assert f"warning: the retrieval run was trained on {mixed / 'u.data'}" in printed
    assert "not a verified clean test" in printed


def test_eval_measures_the_targets_the_ranking_run_itself_trained_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The ranker evaluated on other data than it records: trained on ``mixed``, it saw the
    odd users' ``early`` test targets (every head's figures inflated); on its own data, none."""
    early, mixed = _leaky_data(tmp_path)
    leaky = write_untrained_run(tmp_path / "leaky", load_sequences("ml-100k", mixed))
    own = write_untrained_run(tmp_path / "own", load_sequences("ml-100k", early))
    for ranker, share in ((leaky, 0.5), (own, 0.0)):
        report = tmp_path / f"{ranker.name}.json"
        capsys.readouterr()
        assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-100k", "--data-dir",
                     str(early), "--heads", "ranking", "--no-progress",
                     "--json", str(report)]) == 0
        held = json.loads(report.read_text())["checkpoint_held_out"]
        assert held["targets_in_run_training"] == share
        printed = capsys.readouterr().out
        assert ("warning: 50.0% of these targets are training interactions of the ranking "
                "run" in printed) == bool(share)
        assert ("every head's figures are not a clean test" in printed) == bool(share)


def test_eval_does_not_measure_a_run_on_its_rows_ordering_users_otherwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The ranker's own file rewritten in another order since it was trained: each user's last
    two events tie, so their order is the file's, and the test target of most users is now the
    item the run validated on and trained on (30 of 40 trained on theirs). Rebuilt from the file
    as it is, the run's split would report none: not measured, and said."""
    recorded = write_tied_udata(tmp_path / "data" / "u.data")
    ranker = write_untrained_run(tmp_path / "ranker", load_sequences("ml-100k", recorded),
                                 TINY.with_(valid_users=10, valid_seed=3))
    recorded.write_text(write_tied_udata(tmp_path / "swapped" / "u.data", swapped=True)
                        .read_text())
    report = tmp_path / "report.json"
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-100k", "--data-dir",
                 str(recorded.parent), "--heads", "ranking", "--no-progress",
                 "--json", str(report)]) == 0
    held = json.loads(report.read_text())["checkpoint_held_out"]
    assert held["targets_in_run_training"] is None
    assert "orders its users' sequences otherwise" in held["run_data_unverified"]
    printed = capsys.readouterr().out
    assert f"note: trained on the rows {recorded} holds, but in a file order" in printed
    assert "every head's figures are not a verified clean test" in printed
