"""Readers: one function per file format, each returning an ``InteractionTable``.

Formats:
* GroupLens ``ratings.dat`` (MovieLens-1M/10M): ``UserID::MovieID::Rating::Timestamp``.
* MovieLens-100K ``u.data``: ``user <TAB> item <TAB> rating <TAB> timestamp``.
* A generic interaction table, CSV (optionally gzip-compressed) or Parquet, with named columns
  (``TableSpec``): user, item, and optionally a timestamp and a per-user order column. The
  shared ``ml-1m/ratings_ordered.csv.gz`` is read this way (``ORDERED_ML1M_SPEC``).

Every rating is kept as an implicit interaction (the sequential-recommendation protocol). A
malformed row raises ``DataFormatError`` naming the file and line; nothing is returned partly.
Files ending in ``.gz`` are decompressed on the fly.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import pandas as pd

from relaygr.data.table import InteractionTable
from relaygr.errors import DataFormatError, DatasetNotFoundError, UnknownFormatError

_INT_RE = re.compile(r"^[+-]?\d+$")


def open_text(path: Path) -> TextIO:
    """``path`` opened for reading text, decompressing ``.gz``; a missing file is a typed error."""
    if not path.is_file():
        raise DatasetNotFoundError("no such file", str(path))
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="")
    return path.open("r", encoding="utf-8", errors="replace", newline="")


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Non-blank lines of ``path`` with their 1-based line numbers, line endings stripped; a
    truncated or corrupt ``.gz`` is a ``DataFormatError`` at the line it broke off after."""
    number = 0
    try:
        with open_text(path) as handle:
            for number, raw in enumerate(handle, 1):
                line = raw.rstrip("\r\n")
                if line.strip():
                    yield number, line
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise DataFormatError(f"cannot decompress: {exc}", str(path), number + 1) from None


def _read_four_fields(path: Path, sep: str, layout: str) -> InteractionTable:
    """Lines of ``user sep item sep rating sep timestamp`` (integers; the rating may be a float)."""
    users: list[int] = []
    items: list[int] = []
    times: list[int] = []
    lines: list[int] = []
    for number, line in _numbered_lines(path):
        parts = line.split(sep)
        if len(parts) != 4:
            raise DataFormatError(f"expected 4 fields ({layout}), got {len(parts)}: {line!r}",
                                  str(path), number)
        user, item, rating, stamp = parts
        try:
            users.append(int(user))
            items.append(int(item))
            float(rating)
            times.append(int(stamp))
        except ValueError:
            raise DataFormatError(f"expected numbers ({layout}), got {line!r}",
                                  str(path), number) from None
        lines.append(number)
    return InteractionTable(
        source=str(path), users=np.asarray(users, dtype=np.int64),
        items=np.asarray(items, dtype=np.int64), timestamps=np.asarray(times, dtype=np.int64),
        has_timestamp=np.ones(len(times), dtype=bool), order=None,
        lines=np.asarray(lines, dtype=np.int64))


def read_ratings_dat(path: Path) -> InteractionTable:
    """GroupLens ``ratings.dat`` (or ``.dat.gz``): ``UserID::MovieID::Rating::Timestamp``."""
    return _read_four_fields(Path(path), "::", "UserID::MovieID::Rating::Timestamp")


def read_ml100k(path: Path) -> InteractionTable:
    """MovieLens-100K ``u.data``: ``user item rating timestamp``, tab-separated."""
    return _read_four_fields(Path(path), "\t", "user<TAB>item<TAB>rating<TAB>timestamp")


@dataclass(frozen=True)
class TableSpec:
    """Column names of a generic interaction table.

    ``user`` and ``item`` must be present; ``timestamp`` (unix seconds, empty or null where
    unknown) and ``order`` (an integer position within the user's sequence) are used when the
    file has a column of that name, and ignored otherwise.
    """

    user: str = "user"
    item: str = "item"
    timestamp: str = "timestamp"
    order: str = "order"


ORDERED_ML1M_SPEC = TableSpec(user="user_id", item="movie_id", timestamp="timestamp",
                              order="seq_pos")


def _table_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".csv", ".csv.gz")):
        return "csv"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    raise UnknownFormatError("unknown table format (expected .csv, .csv.gz, .parquet or .pq)",
                             str(path))


def _load_frame(path: Path) -> tuple[pd.DataFrame, np.ndarray, int]:
    """The file as a frame, the line of each row, and the header line (0 for Parquet)."""
    if not path.is_file():
        raise DatasetNotFoundError("no such file", str(path))
    if _table_kind(path) == "parquet":
        try:
            frame = pd.read_parquet(path)
        except (OSError, ValueError) as exc:
            raise DataFormatError(f"cannot read Parquet: {exc}", str(path)) from None
        return frame, np.arange(1, len(frame) + 1, dtype=np.int64), 0
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False,
                            skip_blank_lines=False)
    except pd.errors.EmptyDataError:
        raise DataFormatError("empty file: no header row", str(path), 1) from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        found = re.search(r"line (\d+)", str(exc))
        raise DataFormatError(f"malformed CSV: {exc}", str(path),
                              int(found.group(1)) if found else None) from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:   # a truncated or corrupt .gz
        raise DataFormatError(f"cannot decompress: {exc}", str(path)) from None
    blank = (frame == "").all(axis=1).to_numpy()
    lines = np.arange(2, len(frame) + 2, dtype=np.int64)
    return frame.loc[~blank].reset_index(drop=True), lines[~blank], 1


def _ids(column: pd.Series, name: str, lines: np.ndarray, source: str) -> np.ndarray:
    """Original ids: int64 when every value is an integer, otherwise strings."""
    if pd.api.types.is_integer_dtype(column.dtype) and not column.isna().any():
        return column.to_numpy(dtype=np.int64)
    text = column.astype("string")
    missing = text.isna() | (text.str.strip() == "")
    if missing.any():
        row = int(np.flatnonzero(missing.to_numpy())[0])
        raise DataFormatError(f"empty {name} id", source, int(lines[row]))
    values = text.str.strip()
    if values.str.fullmatch(_INT_RE.pattern).all():
        return values.astype(np.int64).to_numpy()
    return values.to_numpy(dtype=object)


# Integers a float64 holds exactly: a number column read as floats is trusted this far.
_FLOAT_EXACT = 2.0 ** 53


def _integers(column: pd.Series, name: str, lines: np.ndarray, source: str,
              allow_missing: bool) -> tuple[np.ndarray, np.ndarray]:
    """Integer values and a presence mask; a non-integer (or a missing value when not allowed)
    raises with its line."""
    if pd.api.types.is_datetime64_any_dtype(column.dtype):
        present = column.notna().to_numpy()
        seconds = column.astype("datetime64[ns]").astype("int64").to_numpy() // 1_000_000_000
        return np.where(present, seconds, 0), present
    empty = column.isna() | (column.astype("string").str.strip() == "")
    numbers = pd.to_numeric(column.where(~empty), errors="coerce")
    bad = (numbers.isna() & ~empty) | (numbers.notna() & (numbers != np.floor(numbers)))
    if pd.api.types.is_float_dtype(numbers.dtype):
        # inf, 1e30: whole as floats, garbage as int64; past 2^53 a float is not one integer
        bad = bad | (numbers.notna() & ~(numbers.abs() <= _FLOAT_EXACT))
    if not allow_missing:
        bad = bad | empty
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise DataFormatError(f"{name} must be an integer, got {column.iloc[row]!r}", source,
                              int(lines[row]))
    present = (~empty).to_numpy()
    return np.where(present, numbers.fillna(0).to_numpy(), 0).astype(np.int64), present


def read_table(path: Path, spec: TableSpec | None = None) -> InteractionTable:
    """A generic CSV or Parquet interaction table with the columns named by ``spec``."""
    path, spec = Path(path), spec or TableSpec()
    frame, lines, header_line = _load_frame(path)
    source = str(path)
    for required in (spec.user, spec.item):
        if required not in frame.columns:
            raise DataFormatError(f"no column {required!r}; columns are {list(frame.columns)}",
                                  source, header_line or None)
    users = _ids(frame[spec.user], "user", lines, source)
    items = _ids(frame[spec.item], "item", lines, source)
    timestamps = has_timestamp = order = None
    if spec.timestamp in frame.columns:
        timestamps, has_timestamp = _integers(frame[spec.timestamp], "timestamp", lines, source,
                                              allow_missing=True)
    if spec.order in frame.columns:
        order, _ = _integers(frame[spec.order], "order", lines, source, allow_missing=False)
    return InteractionTable(source=source, users=users, items=items, timestamps=timestamps,
                            has_timestamp=has_timestamp, order=order, lines=lines)
