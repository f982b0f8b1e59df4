"""A content fingerprint of an interaction table: the same rows give the same fingerprint,
whatever their order in the file, and other rows another one.

A trained run records the fingerprint of the table it was trained on
(``train.checkpoint.DatasetInfo.fingerprint``), so a file served or evaluated against the run
can be told from one that only has as many users, distinct items and events (the same ratings
with the user ids permuted, a re-sampled export, another dataset cut to the same shape).

Construction: each row's fields (user id, item id, then the timestamp and whether the row has
one when the table has a time column, then the order value when it has an order column) are
chained through SplitMix64's finaliser (``relaygr.splitmix``) into one 64-bit row hash, with a
second hash mixed from it; the fingerprint is BLAKE2b of the row count, the table's shape (which
columns, ids of int or str) and the two sums of those hashes mod 2**64. The sums make it
independent of row order; a sum, unlike xor, counts a repeated row twice (an implicit log repeats
(user, item) rows); and it is a few vectorised passes, cheap enough to compute on every read
(sorting the rows to hash their bytes costs an order of magnitude more). Sums of well-mixed
hashes are no defence against crafted collisions, which this does not need: it tells exports
apart, not adversaries. A str id is hashed by its UTF-8 text (BLAKE2b), an int
id by its value, so neither depends on the id map.

The construction is part of a run's record: changing it would refuse every recorded run's data,
so it must stay fixed (a new one needs a new field name).
"""

from __future__ import annotations

import hashlib

import numpy as np

from relaygr.data.table import InteractionTable
from relaygr.splitmix import GOLDEN_GAMMA, mix64_array

# Salts of the row hash's chain (any fixed odd constants; SplitMix64 is a bijection, so the
# chain keeps the fields apart) and of the second hash derived from it.
_ROW_SEED = 0x726F7773          # "rows"
_SECOND_SALT = 0x7365636F6E64   # "second"


def table_fingerprint(table: InteractionTable) -> str:
    """The fingerprint of ``table``'s rows (module docstring): 32 hex digits."""
    user_bits, user_kind = _id_bits(table.users)
    item_bits, item_kind = _id_bits(table.items)
    with np.errstate(over="ignore"):
        h = mix64_array(user_bits + np.uint64(_ROW_SEED))
        h = mix64_array(h ^ item_bits)
        if table.timestamps is not None:
            assert table.has_timestamp is not None
            stamps = np.where(table.has_timestamp, table.timestamps, 0).astype(np.int64)
            h = mix64_array(h ^ stamps.view(np.uint64))
            h = mix64_array(h + table.has_timestamp.astype(np.uint64) * np.uint64(GOLDEN_GAMMA))
        if table.order is not None:
            h = mix64_array(h ^ table.order.astype(np.int64).view(np.uint64))
        second = mix64_array(h ^ np.uint64(_SECOND_SALT))
        sums = (int(h.sum(dtype=np.uint64)), int(second.sum(dtype=np.uint64)))
    shape = (f"rows={table.num_rows};users={user_kind};items={item_kind};"
             f"time={table.timestamps is not None};order={table.order is not None}")
    digest = hashlib.blake2b(digest_size=16, person=b"relaygr-rows")
    digest.update(shape.encode())
    for total in sums:
        digest.update(total.to_bytes(8, "little"))
    return digest.hexdigest()


def _id_bits(ids: np.ndarray) -> tuple[np.ndarray, str]:
    """``[n]`` uint64 of an id column and its kind: an int id's own bits, a str id's BLAKE2b
    of its text (each distinct id hashed once)."""
    if ids.dtype.kind in "iu":
        return ids.astype(np.int64).view(np.uint64), "int"
    distinct, inverse = np.unique(ids, return_inverse=True)
    hashes = np.fromiter(
        (int.from_bytes(hashlib.blake2b(str(i).encode("utf-8"), digest_size=8,
                                        person=b"relaygr-id").digest(), "little")
         for i in distinct), dtype=np.uint64, count=len(distinct))
    return hashes[inverse.reshape(-1)], "str"
