"""MovieLens-1M as one retrieval domain (the single-domain variant: intra-CL + matching loss).

Reads ``ratings_ordered.csv.gz`` (``user_id,movie_id,rating,timestamp,seq_pos``, each user's rows
in true time order) or a GroupLens ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``,
ordered by timestamp then file order). Every rating is an implicit interaction. Leave-one-out:
each user's last interaction is the test row (``Domain.test`` and ``test_original``), the rest
is training; ``make_split(..., SplitKind.DISENCDR, ...)`` then carves validation from training
and draws the negatives. Ids are made dense (users and movies from 0, in order of first
appearance), so the graph has no isolated padding nodes; the movie and user ids of the file are
kept (``Domain.original_items``, ``DomainPair.original_users``) and a run records them, so a
served run maps to another run's ids through them.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import numpy as np
import pandas as pd

from relaygr.errors import (
    DataError,
    DataFormatError,
    DatasetNotFoundError,
    EmptyDatasetError,
)
from relaygr.retrieval.data import Domain, DomainPair

NAME = "ml1m"


def _read(path: Path) -> pd.DataFrame:
    """``user, item, order`` (integers); a malformed row or file is a ``DataFormatError``."""
    if path.name.startswith("ratings_ordered"):
        table = pd.read_csv(path, usecols=["user_id", "movie_id", "seq_pos"])
        table = table.rename(columns={"user_id": "user", "movie_id": "item", "seq_pos": "order"})
    else:
        table = pd.read_csv(path, sep="::", engine="python", header=None, dtype=str,
                            names=["user", "item", "rating", "order"])[["user", "item", "order"]]
        # a row of three fields leaves its timestamp empty: it would sort last and become its
        # user's test item; every field must be an integer
        table = table.apply(pd.to_numeric, errors="coerce")
        bad = table.isna().any(axis=1).to_numpy()
        if bad.any():
            row = int(bad.argmax()) + 1
            raise DataFormatError(f"rating {row} is not UserID::MovieID::Rating::Timestamp "
                                  "with integer ids and timestamp", str(path))
    for column in table.columns:             # a missing or non-integer value anywhere
        if not pd.api.types.is_integer_dtype(table[column]):
            raise DataFormatError(f"column {column!r} holds a missing or non-integer value",
                                  str(path))
    return table


def load_movielens(path: Path) -> DomainPair:
    """``path``: the file, or a folder holding ``ratings.dat`` or ``ratings_ordered.csv.gz``
    (``ratings.dat`` first where it holds both, as the ranker's reader does, ``relaygr.data``'s
    ``DATASET_FILES``: the two break timestamp ties differently, so a user's last event, which
    both hold out, would differ). Returns a one-domain ``DomainPair`` (``source`` is the same
    domain; use ``domains[:1]``)."""
    path = Path(path)
    if path.is_dir():
        found = [path / n for n in ("ratings.dat", "ratings_ordered.csv.gz")
                 if (path / n).is_file()]
        if not found:
            raise DatasetNotFoundError("no ratings_ordered.csv.gz or ratings.dat", str(path))
        path = found[0]
    if not path.is_file():
        raise DatasetNotFoundError("file not found", str(path))
    try:
        table = _read(path)
    except (ValueError, KeyError, OSError, EOFError, zlib.error) as exc:
        # OSError and EOFError: a truncated or corrupt .gz (DataFormatError is a ValueError)
        if isinstance(exc, DataError):
            raise
        raise DataFormatError(f"cannot parse: {exc}", str(path)) from None
    if table.empty:
        raise EmptyDatasetError("no ratings", str(path))
    table = table.sort_values(["user", "order"], kind="stable")
    users, user_ids = pd.factorize(table["user"])
    items, item_ids = pd.factorize(table["item"])
    pairs = np.stack([users, items], axis=1).astype(np.int64)
    last = np.r_[users[1:] != users[:-1], True]
    domain = Domain(NAME, path.parent, pairs[~last], pairs[last], pairs[last],
                    int(items.max()) + 1, hashlib.sha256(path.read_bytes()).hexdigest()[:16],
                    np.asarray(item_ids, dtype=np.int64), time_ordered=True)
    return DomainPair(domain, domain, int(users.max()) + 1, np.asarray(user_ids, dtype=np.int64))
