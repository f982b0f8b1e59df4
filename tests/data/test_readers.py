"""Every reader round-trips small files the tests write, and bad files fail with file and line."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from relaygr.data import TableSpec, read_ml100k, read_ratings_dat, read_table, resolve
from relaygr.errors import (
    DataFormatError,
    DatasetNotFoundError,
    EmptyDatasetError,
    UnknownFormatError,
)

ROWS = [(3, 30, 4, 300), (1, 10, 5, 100), (3, 31, 2, 250), (1, 12, 3, 90)]


def _dat_text(rows: list[tuple[int, int, int, int]]) -> str:
    return "".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows)


def test_ratings_dat_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "ratings.dat"
    path.write_text(_dat_text(ROWS))
    table = read_ratings_dat(path)
    assert table.users.tolist() == [3, 1, 3, 1]
    assert table.items.tolist() == [30, 10, 31, 12]
    assert table.timestamps is not None and table.timestamps.tolist() == [300, 100, 250, 90]
    assert table.has_timestamp is not None and table.has_timestamp.all()
    assert table.order is None and table.lines.tolist() == [1, 2, 3, 4]
    assert table.source == str(path)


def test_ratings_dat_gz_and_blank_lines_are_read(tmp_path: Path) -> None:
    path = tmp_path / "ratings.dat.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(_dat_text(ROWS[:2]) + "\n" + _dat_text(ROWS[2:]))
    table = read_ratings_dat(path)
    assert table.items.tolist() == [30, 10, 31, 12]
    assert table.lines.tolist() == [1, 2, 4, 5]  # line 3 is blank


def test_ml100k_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "u.data"
    path.write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ROWS))
    table = read_ml100k(path)
    assert table.users.tolist() == [3, 1, 3, 1] and table.items.tolist() == [30, 10, 31, 12]
    assert table.timestamps is not None and table.timestamps.tolist() == [300, 100, 250, 90]


@pytest.mark.parametrize(("line", "reason"), [
    ("1::10::5", "expected 4 fields"),
    ("1::10::5::100::7", "expected 4 fields"),
    ("1::ten::5::100", "expected numbers"),
    ("1::10::five::100", "expected numbers"),
])
def test_ratings_dat_malformed_row_names_file_and_line(tmp_path: Path, line: str,
                                                       reason: str) -> None:
    path = tmp_path / "ratings.dat"
    path.write_text(_dat_text(ROWS[:2]) + line + "\n" + _dat_text(ROWS[2:]))
    with pytest.raises(DataFormatError, match=reason) as info:
        read_ratings_dat(path)
    assert (info.value.path, info.value.line) == (str(path), 3)
    assert str(info.value).startswith(f"{path}:3: ")


def test_truncated_or_corrupt_gz_files_are_format_errors(tmp_path: Path) -> None:
    whole = tmp_path / "ratings.dat.gz"
    with gzip.open(whole, "wt") as fh:
        fh.write(_dat_text(ROWS * 200))
    cut = tmp_path / "cut" / "ratings.dat.gz"
    cut.parent.mkdir()
    cut.write_bytes(whole.read_bytes()[:len(whole.read_bytes()) // 2])
    with pytest.raises(DataFormatError, match="cannot decompress"):
        read_ratings_dat(cut)
    fake = tmp_path / "fake.csv.gz"
    fake.write_text("user,item\n1,2\n")                  # not gzip at all
    with pytest.raises(DataFormatError, match="cannot decompress"):
        read_table(fake)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "ratings.dat"
    empty.write_text("\n\n")
    with pytest.raises(EmptyDatasetError, match="no interactions"):
        read_ratings_dat(empty)
    with pytest.raises(DatasetNotFoundError):
        read_ratings_dat(tmp_path / "absent.dat")
    header_only = tmp_path / "t.csv"
    header_only.write_text("user,item\n")
    with pytest.raises(EmptyDatasetError):
        read_table(header_only)


def test_csv_table_with_missing_timestamps_and_order(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("uid,iid,ts,pos\n"
                    "a,x,100,1\n"
                    "a,y,,0\n"
                    "b,x,978300019,0\n")
    table = read_table(path, TableSpec(user="uid", item="iid", timestamp="ts", order="pos"))
    assert table.users.tolist() == ["a", "a", "b"] and table.items.tolist() == ["x", "y", "x"]
    assert table.has_timestamp is not None and table.has_timestamp.tolist() == [True, False, True]
    assert table.timestamps is not None and table.timestamps.tolist() == [100, 0, 978300019]
    assert table.order is not None and table.order.tolist() == [1, 0, 0]
    assert table.lines.tolist() == [2, 3, 4]


def test_csv_integer_ids_and_float_timestamps(tmp_path: Path) -> None:
    path = tmp_path / "t.csv.gz"
    pd.DataFrame({"user": [2, 1], "item": [7, 9],
                  "timestamp": [978300019.0, np.nan]}).to_csv(path, index=False)
    table = read_table(path)
    assert table.users.dtype == np.int64 and table.users.tolist() == [2, 1]
    assert table.timestamps is not None and table.timestamps.tolist() == [978300019, 0]
    assert table.has_timestamp is not None and table.has_timestamp.tolist() == [True, False]
    assert table.order is None


def test_parquet_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    stamps = pd.to_datetime([100, None, 300], unit="s")
    pd.DataFrame({"user": [5, 5, 6], "item": ["p", "q", "p"], "timestamp": stamps,
                  "order": [0, 1, 0]}).to_parquet(path)
    table = read_table(path)
    assert table.users.tolist() == [5, 5, 6] and table.items.tolist() == ["p", "q", "p"]
    assert table.timestamps is not None and table.timestamps.tolist() == [100, 0, 300]
    assert table.has_timestamp is not None and table.has_timestamp.tolist() == [True, False, True]
    assert table.lines.tolist() == [1, 2, 3]


@pytest.mark.parametrize(("body", "line", "reason"), [
    ("user,item,timestamp\n1,2,3\n1,,4\n", 3, "empty item id"),
    ("user,item,timestamp\n1,2,3\n1,3,soon\n", 3, "timestamp must be an integer"),
    ("user,item,timestamp\n1,2,3\n1,3,4.5\n", 3, "timestamp must be an integer"),
    ("user,item,timestamp\n1,2,3\n1,3,inf\n", 3, "timestamp must be an integer"),
    ("user,item,timestamp\n1,2,3.0\n1,3,1e30\n", 3, "timestamp must be an integer"),
    ("user,item,timestamp\n1,2,3\n1,3,-inf\n", 3, "timestamp must be an integer"),
    ("user,item,order\n1,2,0\n1,3,\n", 3, "order must be an integer"),
    ("user,item\n1,2\n1,3,4,5\n", 3, "malformed CSV"),
])
def test_csv_malformed_rows_name_the_line(tmp_path: Path, body: str, line: int,
                                          reason: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(body)
    with pytest.raises(DataFormatError, match=reason) as info:
        read_table(path)
    assert info.value.line == line and info.value.path == str(path)


def test_missing_column_and_unknown_format(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("person,item\n1,2\n")
    with pytest.raises(DataFormatError, match="no column 'user'"):
        read_table(path)
    other = tmp_path / "t.xlsx"
    other.write_text("x")
    with pytest.raises(UnknownFormatError):
        read_table(other)
    with pytest.raises(UnknownFormatError, match="unknown dataset"):
        resolve("ml-42m", tmp_path)
    with pytest.raises(DatasetNotFoundError, match=r"looked for u\.data"):
        resolve("ml-100k", tmp_path)
