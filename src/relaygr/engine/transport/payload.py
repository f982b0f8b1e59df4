"""A prefix as it crosses a process boundary: its events, rebuilt into a ``PrefixSpec`` there.

A ``PrefixSpec`` carries ``version_at`` (the history store's versions of the user's shorter
prefixes), which is a call into the sender's store. The receiver derives it from the events with the
store's own hash (``engine.versions``) instead, and checks it against the version the sender sent. A
windowed prefix (``cascade.window``) carries its window's start, which its versions hash too, and
a prefix with a continuation time (``PrefixSpec.next_timestamp``) that time, which its versions
are salted with (``engine.versions.continued``: each shorter prefix's is the next event's time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from relaygr.engine.types import PrefixSpec
from relaygr.engine.versions import continued, event_hash_sums, version_of
from relaygr.kvcache import PrefixId

# Versions are uint64 hashes; this matches none of them.
UNKNOWN_VERSION = -1


@dataclass(frozen=True)
class PrefixPayload:
    """A user's long-term prefix as events: what an instance in another process needs to
    pre-infer or recompute it. The events are the user's ``window_start..`` (the window the
    model reads; 0 while the history fits it)."""

    pid: PrefixId
    items: np.ndarray              # [n] int64
    timestamps: np.ndarray | None  # [n] int64, None for an untimed user
    window_start: int = 0
    next_timestamp: int | None = None

    def continuation_at(self, n: int) -> int | None:
        """The continuation time of the first ``n`` events (``PrefixKV.next_timestamp``): the
        next event's time, or the prefix's own at its end; None where the prefix has none
        (what each shorter prefix's version is salted with, ``versions.continued``)."""
        if self.next_timestamp is None or self.timestamps is None:
            return None
        return self.next_timestamp if n == self.pid.num_tokens else int(self.timestamps[n])

    def to_spec(self) -> PrefixSpec:
        items = np.ascontiguousarray(self.items, dtype=np.int64)
        ts = None if self.timestamps is None else \
            np.ascontiguousarray(self.timestamps, dtype=np.int64)
        start = self.window_start
        sums = event_hash_sums(items, ts, start, 0)
        timed = ts is not None

        def version_at(n: int) -> int:
            return continued(version_of(int(sums[n - 1]) if n else 0, n, timed, start),
                             self.continuation_at(n))

        if version_at(items.shape[0]) != self.pid.version:
            # The sender's store hashes differently: only this exact prefix is known, so a
            # shorter host copy is never mistaken for one of its prefixes (safe, just no reuse).
            full, version = items.shape[0], self.pid.version

            def version_at(n: int) -> int:
                return version if n == full else UNKNOWN_VERSION

        return PrefixSpec(self.pid, torch.from_numpy(items.copy()),
                          None if ts is None else torch.from_numpy(ts.copy()), version_at,
                          start, self.next_timestamp)

    @classmethod
    def of(cls, spec: PrefixSpec) -> PrefixPayload:
        ts = None if spec.timestamps is None else spec.timestamps.numpy()
        return cls(spec.pid, spec.items.numpy(), ts, spec.window_start, spec.next_timestamp)
