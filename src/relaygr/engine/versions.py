"""The version of a run of events: the hash that ``PrefixId.version`` is made of.

A cached prefix is fresh exactly when its version equals the version of the events it was built
from. The history store (``cascade.store``, ``cascade.redis_store``) keeps running sums of these
hashes per user so ``version_at`` is O(1); a prefix sent to another process as events
(``engine.transport.payload``) is given its versions again from the same hashes there. Both use
the functions here, so the two sides cannot disagree.
"""

from __future__ import annotations

import numpy as np

from relaygr.splitmix import GOLDEN_GAMMA, MASK64, mix64, mix64_array

_TIMED_TAG, _UNTIMED_TAG = 0x54494D4544, 0x554E54494D4544   # keep timed and untimed apart
_WINDOW_TAG = 0x57494E444F57                                # a window's start, hashed apart
_CONTINUATION_TAG = 0x4E455854                              # a continuation time, hashed apart


def event_hash_sums(items: np.ndarray, timestamps: np.ndarray | None, start: int,
                    base: int) -> np.ndarray:
    """Running sums ``[k]`` after events at positions ``start..start+k-1``, from ``base``."""
    positions = np.arange(start, start + items.shape[0], dtype=np.uint64)
    h = mix64_array(items.astype(np.uint64))
    if timestamps is not None:
        h = mix64_array(h ^ timestamps.view(np.uint64))
    with np.errstate(over="ignore"):
        h = mix64_array(h + positions * np.uint64(GOLDEN_GAMMA))
        return np.cumsum(h, dtype=np.uint64) + np.uint64(base)


def version_of(hash_sum: int, num_events: int, timed: bool, start: int = 0) -> int:
    """The version of ``num_events`` events from position ``start`` whose position-salted
    hashes (``event_hash_sums`` from ``start``, base 0) sum to ``hash_sum`` mod 2**64."""
    tag = _TIMED_TAG if timed else _UNTIMED_TAG
    version = mix64(hash_sum ^ mix64(num_events * GOLDEN_GAMMA + tag))
    return version if start == 0 else mix64(version ^ mix64(start * GOLDEN_GAMMA + _WINDOW_TAG))


def continued(version: int, next_timestamp: int | None) -> int:
    """The version of a prefix computed for a continuation at ``next_timestamp`` (under
    ``time_query="next"``, ``PrefixKV.next_timestamp``: its last token's K/V depends on that
    time): its events' ``version`` salted with the time, so the same events computed for
    another time are another prefix. ``version`` itself when ``next_timestamp`` is None."""
    if next_timestamp is None:
        return version
    return mix64(version ^ mix64((next_timestamp & MASK64) * GOLDEN_GAMMA + _CONTINUATION_TAG))
