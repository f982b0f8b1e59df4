"""An interaction log as read from a file: parallel columns in file order, nothing inferred yet.

Every reader in ``relaygr.data.readers`` returns an ``InteractionTable``; ``relaygr.data.sequences``
turns one into time-ordered user sequences. Keeping the raw table separate means each reader only
parses, and the ordering and id rules live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relaygr.errors import EmptyDatasetError


@dataclass(frozen=True)
class InteractionTable:
    """Columns of one interaction file, row ``i`` of each column describing one event.

    Invariants (checked at construction): every column has the same length ``num_rows > 0``;
    ``users`` and ``items`` hold original ids, int64 or str (object dtype); ``timestamps`` is
    int64 unix seconds and meaningful only where ``has_timestamp`` is True (both None when the
    format has no time column); ``order`` is an int64 per-user sequence position or None;
    ``lines`` holds the 1-based line of each row in ``source`` (for Parquet: the 1-based row),
    used to point errors at the offending row.
    """

    source: str
    users: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray | None
    has_timestamp: np.ndarray | None
    order: np.ndarray | None
    lines: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.lines)
        if n == 0:
            raise EmptyDatasetError("no interactions", self.source)
        columns = {"users": self.users, "items": self.items, "timestamps": self.timestamps,
                   "has_timestamp": self.has_timestamp, "order": self.order}
        for name, column in columns.items():
            assert column is None or len(column) == n, f"column {name} has {len(column)} != {n}"
        assert (self.timestamps is None) == (self.has_timestamp is None), \
            "timestamps and has_timestamp come together"

    @property
    def num_rows(self) -> int:
        return len(self.lines)

    @property
    def has_time_column(self) -> bool:
        return self.timestamps is not None
