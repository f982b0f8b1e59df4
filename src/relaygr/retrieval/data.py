"""A cross-domain pair as arrays: each domain's train / test / test_original interactions.

Layout (DisenCDR's release): ``DATA_DIR/<a>_<b>/`` holds domain ``a``'s side of the pair a/b and
``DATA_DIR/<b>_<a>/`` domain ``b``'s; user ids are shared across the two folders. Each file has
lines ``user item [1]``. Item ids are per domain; ``num_items`` covers every file of the domain
(``test_original`` may name items never seen in training). Nothing is copied: arrays are read
from the caller's folder.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from relaygr.errors import DataFormatError, DatasetNotFoundError, EmptyDatasetError

FILES = ("train.txt", "test.txt", "test_original.txt")


@dataclass(frozen=True)
class Domain:
    """One domain's interactions, ``(n, 2)`` int64 arrays of ``(user, item)``."""

    name: str
    folder: Path
    train: np.ndarray
    test: np.ndarray
    test_original: np.ndarray
    num_items: int
    digest: str            # sha256 (first 16 hex) of the three files, in FILES order
    # The source's id of each dense item (index = item id); None: the files' ids are the ids.
    original_items: np.ndarray | None = None
    # Whether each user's ``train`` rows are in time order, oldest first (MovieLens, read with
    # its timestamps); the DisenCDR files carry no time.
    time_ordered: bool = False

    def item_catalogue(self) -> np.ndarray:
        """``(num_items,)`` int64: the source's id of every item id of this domain."""
        if self.original_items is None:
            return np.arange(self.num_items, dtype=np.int64)
        return np.asarray(self.original_items, dtype=np.int64)


@dataclass(frozen=True)
class DomainPair:
    """The target domain (named by ``--pair``) and its partner, over ``num_users`` shared ids."""

    target: Domain
    source: Domain
    num_users: int
    # The source's id of each dense user (index = user id); None: the files' ids are the ids.
    original_users: np.ndarray | None = None

    def user_catalogue(self) -> np.ndarray:
        """``(num_users,)`` int64: the source's id of every user id."""
        if self.original_users is None:
            return np.arange(self.num_users, dtype=np.int64)
        return np.asarray(self.original_users, dtype=np.int64)

    @property
    def domains(self) -> tuple[Domain, Domain]:
        return (self.target, self.source)

    def summary(self) -> dict[str, object]:
        return {"num_users": self.num_users, "domains": [
            {"name": d.name, "folder": str(d.folder), "num_items": d.num_items,
             "train": len(d.train), "test": len(d.test), "test_original": len(d.test_original),
             "sha256_16": d.digest} for d in self.domains]}


def read_pairs(path: Path) -> np.ndarray:
    """``user item [label]`` lines → ``(n, 2)`` int64; malformed lines raise ``DataFormatError``."""
    if not path.is_file():
        raise DatasetNotFoundError("file not found", str(path))
    rows: list[tuple[int, int]] = []
    lineno = 0
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                parts = line.split()
                if not parts:
                    continue
                if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "1"):
                    # a third field other than 1 would be a negative: not an interaction
                    raise DataFormatError(f"expected 'user item [1]', got {line.strip()!r}",
                                          str(path), lineno)
                try:
                    user, item = int(parts[0]), int(parts[1])
                except ValueError:
                    raise DataFormatError(f"non-integer id in {line.strip()!r}", str(path),
                                          lineno) from None
                if not (0 <= user < _MAX_ID and 0 <= item < _MAX_ID):
                    raise DataFormatError("id out of range (0 .. 2^62)", str(path), lineno)
                rows.append((user, item))
    except UnicodeDecodeError as exc:
        raise DataFormatError(f"not UTF-8 text: {exc}", str(path), lineno + 1) from None
    if not rows:
        raise EmptyDatasetError("no interactions", str(path))
    return np.asarray(rows, dtype=np.int64)


_MAX_ID = 1 << 62


def load_domain(folder: Path) -> Domain:
    """Read one ``<a>_<b>`` folder; the domain's name is ``a``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetNotFoundError("pair folder not found", str(folder))
    arrays = [read_pairs(folder / name) for name in FILES]
    sha = hashlib.sha256()
    for name in FILES:
        sha.update((folder / name).read_bytes())
    num_items = int(max(a[:, 1].max() for a in arrays)) + 1
    return Domain(folder.name.split("_")[0], folder, arrays[0], arrays[1], arrays[2], num_items,
                  sha.hexdigest()[:16])


def partner_folder(data_dir: Path, pair: str) -> Path:
    """``sport_cloth`` → ``DATA_DIR/cloth_sport``."""
    parts = pair.split("_")
    if len(parts) != 2 or not all(parts):
        raise DatasetNotFoundError(f"a pair is named '<target>_<source>'; got {pair!r}")
    return Path(data_dir) / f"{parts[1]}_{parts[0]}"


def load_pair(data_dir: Path, pair: str) -> DomainPair:
    """Both sides of ``pair`` (e.g. ``sport_cloth``: target sport, source cloth)."""
    target = load_domain(Path(data_dir) / pair)
    source = load_domain(partner_folder(data_dir, pair))
    num_users = int(max(a[:, 0].max() for d in (target, source)
                        for a in (d.train, d.test, d.test_original))) + 1
    return DomainPair(target, source, num_users)
