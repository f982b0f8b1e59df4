"""MovieLens as one domain: leave-one-out by each user's order, dense ids, single-domain runs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from relaygr.cli.main import main
from relaygr.errors import DataFormatError, DatasetNotFoundError
from relaygr.retrieval.movielens import load_movielens


def _write(path: Path, users: int = 30, items: int = 1100, per_user: int = 8) -> Path:
    rng = np.random.default_rng(0)
    rows = ["user_id,movie_id,rating,timestamp,seq_pos"]
    for u in range(users):
        for pos, item in enumerate(rng.choice(items, size=per_user, replace=False)):
            rows.append(f"{u + 1},{item + 5},4,,{pos}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(rows) + "\n")
    return path


def test_leave_one_out_holds_out_each_users_last_item(tmp_path: Path) -> None:
    path = tmp_path / "ratings_ordered.csv.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as fh:   # user 7's rows out of order: seq_pos decides
        fh.write("user_id,movie_id,rating,timestamp,seq_pos\n7,50,5,,1\n7,40,3,,0\n7,60,4,,2\n"
                 "9,40,1,,0\n9,70,2,,1\n")
    pair = load_movielens(tmp_path)
    d = pair.target
    assert pair.num_users == 2 and d.num_items == 4         # dense: 7->0, 9->1; 40,50,60,70
    assert d.test.tolist() == [[0, 2], [1, 3]]               # last: movie 60 and movie 70
    assert sorted(map(tuple, d.train.tolist())) == [(0, 0), (0, 1), (1, 0)]
    with pytest.raises(DatasetNotFoundError):
        load_movielens(tmp_path / "missing")
    # beside a ratings.dat, that file is read, as the ranker's reader reads it (the two break
    # timestamp ties differently, and both hold out each user's last event)
    (tmp_path / "ratings.dat").write_text("7::40::3::100\n7::80::5::200\n9::40::1::100\n"
                                           "9::70::2::150\n")
    d = load_movielens(tmp_path).target
    assert d.num_items == 3 and d.original_items is not None
    assert d.original_items[d.test[:, 1]].tolist() == [80, 70]


def test_malformed_or_truncated_files_are_typed_errors_never_silent_rows(tmp_path: Path) -> None:
    """A ratings.dat row of three fields would have sorted last and become its user's test
    item; a non-integer id or a truncated .gz would have raised untyped: each is a
    DataFormatError naming the file (and the line where there is one)."""
    dat = tmp_path / "dat" / "ratings.dat"
    dat.parent.mkdir()
    dat.write_text("1::10::5::100\n1::11::4\n1::12::3::50\n2::10::4::70\n")
    with pytest.raises(DataFormatError, match="rating 2 is not UserID::MovieID"):
        load_movielens(dat.parent)
    dat.write_text("1::10::5::100\n1::abc::4::101\n")
    with pytest.raises(DataFormatError, match="rating 2 is not"):
        load_movielens(dat.parent)
    csv = tmp_path / "csv" / "ratings_ordered.csv.gz"
    csv.parent.mkdir()
    with gzip.open(csv, "wt") as fh:
        fh.write("user_id,movie_id,rating,timestamp,seq_pos\n1,abc,4,,0\n1,7,4,,1\n")
    with pytest.raises(DataFormatError, match="'item' holds a missing or non-integer"):
        load_movielens(csv)
    whole = _write(tmp_path / "whole" / "ratings_ordered.csv.gz")
    cut = tmp_path / "cut" / "ratings_ordered.csv.gz"
    cut.parent.mkdir()
    cut.write_bytes(whole.read_bytes()[:len(whole.read_bytes()) // 2])
    with pytest.raises(DataFormatError, match="cannot parse"):
        load_movielens(cut)


def test_single_domain_run_on_movielens(tmp_path: Path) -> None:
    data = _write(tmp_path / "ml" / "ratings_ordered.csv.gz")
    run = tmp_path / "run"
    assert main(["train-retrieval", "--dataset", "ml-1m", "--data-dir", str(data.parent),
                 "--out", str(run), "--preset", "single", "--split", "cvgae",
                 "--set", "lambda_intra=0.1", "--set", "dim=8", "--set", "max_epochs=2",
                 "--set", "batch_size=128", "--set", "num_negatives=32",
                 "--no-progress"]) == 0
    out = tmp_path / "full.json"
    assert main(["eval-retrieval", "--checkpoint", str(run), "--protocol", "full",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["model"]) == ["ml1m"] and report["pair"] == "ml-1m"


def test_a_pair_file_with_negatives_foreign_bytes_or_huge_ids_is_refused(tmp_path: Path) -> None:
    from relaygr.retrieval.data import read_pairs

    cases = {b"0 1 1\n0 2 0\n": "expected 'user item \\[1\\]'",       # a negative, not a purchase
             b"0 1\n\xff\xfe 2\n": "not UTF-8",
             b"0 99999999999999999999\n": "id out of range"}
    for i, (body, words) in enumerate(cases.items()):
        path = tmp_path / f"train{i}.txt"
        path.write_bytes(body)
        with pytest.raises(DataFormatError, match=words):
            read_pairs(path)


def test_an_id_map_of_another_shape_is_a_checkpoint_error(tmp_path: Path) -> None:
    from relaygr.data import IdMap
    from relaygr.errors import CheckpointError

    for body in ("[1, 2]", '{"format": "relaygr-id-map/1", "items": [[1], 2]}', "7"):
        path = tmp_path / "id_map.json"
        path.write_text(body)
        with pytest.raises(CheckpointError, match="not a relaygr id map"):
            IdMap.load(path)
