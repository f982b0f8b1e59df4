"""Named datasets: which file in a data directory to read, and with which reader.

``--dataset`` names:
* ``ml-1m``: a MovieLens-1M directory holding the GroupLens ``ratings.dat`` (as downloaded, or
  ``.gz``) or the shared ``ratings_ordered.csv.gz`` (whose users 3000-6040 carry no timestamps).
* ``ml-100k``: a MovieLens-100K directory holding ``u.data``.
* ``ratings-dat``: any file in the ``ratings.dat`` format (or a directory holding ``ratings.dat``).
* ``table``: a generic CSV/Parquet interaction table (see ``readers.TableSpec``), given as the
  file itself or a directory holding ``interactions.{csv,csv.gz,parquet}``.

``data_dir`` may also name the file directly for every dataset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from relaygr.data.readers import (
    ORDERED_ML1M_SPEC,
    TableSpec,
    read_ml100k,
    read_ratings_dat,
    read_table,
)
from relaygr.data.sequences import IdMap, UserEvents, UserSequences, build_sequences
from relaygr.data.table import InteractionTable
from relaygr.errors import DatasetNotFoundError, UnknownFormatError

Reader = Callable[[Path], InteractionTable]


def _reader_for_file(path: Path, spec: TableSpec | None) -> Reader:
    name = path.name.lower()
    if name.startswith("ratings_ordered"):
        return lambda p: read_table(p, ORDERED_ML1M_SPEC)
    if name.endswith((".dat", ".dat.gz")):
        return read_ratings_dat
    if name.endswith(".data"):
        return read_ml100k
    if name.endswith((".csv", ".csv.gz", ".parquet", ".pq")):
        return lambda p: read_table(p, spec)
    raise UnknownFormatError("cannot tell the format of this file", str(path))


# Files looked for in a dataset directory, in order of preference.
DATASET_FILES: dict[str, tuple[str, ...]] = {
    "ml-1m": ("ratings.dat", "ratings.dat.gz", "ratings_ordered.csv.gz", "ratings_ordered.csv"),
    "ml-100k": ("u.data",),
    "ratings-dat": ("ratings.dat", "ratings.dat.gz"),
    "table": ("interactions.parquet", "interactions.csv", "interactions.csv.gz"),
}


@dataclass(frozen=True)
class DatasetSource:
    """A resolved dataset: its name, the file to read and the reader for it."""

    name: str
    path: Path
    reader: Reader

    def read(self) -> InteractionTable:
        return self.reader(self.path)


def resolve(dataset: str, data_dir: Path, spec: TableSpec | None = None) -> DatasetSource:
    """The file of ``dataset`` under ``data_dir`` (or ``data_dir`` itself when it is a file)."""
    if dataset not in DATASET_FILES:
        raise UnknownFormatError(f"unknown dataset {dataset!r}; choose one of "
                                 f"{sorted(DATASET_FILES)}")
    data_dir = Path(data_dir)
    if data_dir.is_file():
        return DatasetSource(dataset, data_dir, _reader_for_file(data_dir, spec))
    if not data_dir.is_dir():
        raise DatasetNotFoundError("no such file or directory", str(data_dir))
    for name in DATASET_FILES[dataset]:
        path = data_dir / name
        if path.is_file():
            return DatasetSource(dataset, path, _reader_for_file(path, spec))
    raise DatasetNotFoundError(f"no {dataset} file here; looked for "
                               f"{', '.join(DATASET_FILES[dataset])}", str(data_dir))


def load_sequences(dataset: str, data_dir: Path, spec: TableSpec | None = None,
                   id_map: IdMap | None = None, drop_unknown_items: bool = False
                   ) -> UserSequences:
    """Read ``dataset`` from ``data_dir`` and build time-ordered user sequences.

    Pass a trained model's ``id_map`` to get that model's dense ids (items it does not know
    raise, or are dropped with ``drop_unknown_items``); without one, ids are fitted to the data.
    """
    table = resolve(dataset, data_dir, spec).read()
    return build_sequences(table, id_map, drop_unknown_items)


def iter_histories(dataset: str, data_dir: Path, id_map: IdMap | None = None,
                   spec: TableSpec | None = None, drop_unknown_items: bool = False
                   ) -> Iterator[UserEvents]:
    """Each user's time-ordered history (dense and original item ids, timestamps when known),
    users in sorted order of their original id. See ``load_sequences`` for the arguments."""
    yield from load_sequences(dataset, data_dir, spec, id_map, drop_unknown_items).histories()
