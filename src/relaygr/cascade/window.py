"""The window of a user's history that the ranking model reads, and how it slides.

A history grows without bound; the model reads at most ``W = max_seq_len`` events (prefix plus
the visit's suffix). It reads the newest ones, from a window start that moves forward only in
whole blocks of ``B = slide_tokens`` events. For ``T`` events in all (stored + the visit's)::

    start(T) = 0                          while T <= W
    start(T) = ceil((T - W) / B) * B      after: the window holds W - B + 1 .. W events

Window event ``i`` (history event ``start + i``) sits at model position ``i``.

Exactness. A cached prefix is keyed by ``PrefixId(user, tokens, version)`` and its version
hashes the window's events *and its start* (``HistoryStore.version_at(user, n, start)``):

* Between slides the start is fixed, so the window only grows at its end: a cached prefix of it
  (events ``start..m-1`` at positions ``0..m-start-1``) is a true prefix of what the model reads
  next, and every relay path reuses it exactly (device hit, pre-infer, host reload extended with
  the new events, the ranked suffix kept for the next visit).
* At a slide every event moves to another position (the absolute position embedding is added at
  the input and the relative bias follows the positions), so no K/V computed for the old window
  is valid. Nothing of it is reused: its version no longer matches, the new window is computed
  in full once (pre-inferred, or the ranking pass's full path, which fills the cache), and the
  old entry is superseded when the new one is admitted (one entry per user and tier) or ages
  out. It is never served. The cost is one full-window computation per ``B`` appended events.

The full pass (the ``baseline`` mode, and every cache miss) reads the same window, so cached
scores equal the full pass's after any number of slides.

A time query from the next event (``HSTUConfig.time_query="next"``). Each history token's
K/V (from the second layer on) depends on the time of the event after it, so a cached prefix is
exact only for the continuation time it was computed for, which its identity includes
(``engine.versions.continued``). The prefix of a timed history therefore stops one event short:
that newest stored event, whose follower is the visit's first event or the request, is *held
back* and ranked with the visit's events, so the prefix's continuation is a stored event's time,
the same on every visit. The ranking pass leaves its last token out of what it keeps
(``model.hstu.RankOutput``), so the kept prefix again stops one event short, which is the next
visit's prefix. A window holding a single stored event holds nothing back; its prefix is
computed for this visit's continuation (the first new event's time, else the request's, else
its own), which the next visit will not share: correct, but reused only by a retry.

Limits. A visit's suffix (``recent_items``, or ``/v1/prefill``'s ``suffix_tokens``) may hold at
most ``W - B`` events, so the window never starts inside it (longer ones are refused with a
``SequenceTooLongError``); the stored history has no limit (appends of any length are kept whole,
and the model reads their newest window). A history's length alone never refuses a request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.history_checks import check_suffix_timestamps
from relaygr.cascade.store import HistoryStore
from relaygr.engine.transport.payload import PrefixPayload
from relaygr.engine.versions import continued
from relaygr.errors import ConfigError, InvalidInputError, SequenceTooLongError
from relaygr.kvcache import PrefixId
from relaygr.model import HSTUConfig


@dataclass(frozen=True)
class VisitPrefix:
    """The window's prefix of a visit (``prefix``), and the stored events after it that the
    ranking pass computes with the visit's own: none, or the one held back under a time query
    from the next event (the module docstring)."""

    payload: PrefixPayload
    held_items: np.ndarray              # [0 or 1] int64
    held_timestamps: np.ndarray | None

    @property
    def held(self) -> int:
        return int(self.held_items.shape[0])


@dataclass(frozen=True)
class HistoryWindow:
    """``W = max_tokens`` events read, sliding in blocks of ``B = slide_tokens`` (see the module
    docstring); ``1 <= B < W``. ``next_time_query``: the model measures each token's time bias
    from the next event's time (a timed prefix holds its newest event back)."""

    max_tokens: int
    slide_tokens: int
    next_time_query: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.slide_tokens < self.max_tokens:
            raise ConfigError(f"a history window needs 1 <= slide_tokens < max_tokens, got "
                              f"slide_tokens {self.slide_tokens}, max_tokens {self.max_tokens}")

    @classmethod
    def for_model(cls, model: HSTUConfig, system: SystemConfig) -> HistoryWindow:
        """The window of ``model`` (``max_seq_len``) sliding by ``system``'s fraction of it."""
        width = model.max_seq_len
        return cls(width, max(1, int(width * system.window_slide_fraction)),
                   model.next_time_query)

    @property
    def max_suffix_tokens(self) -> int:
        """The most events a visit may add to what the model reads (``W - B``)."""
        return self.max_tokens - self.slide_tokens

    def start(self, total_events: int) -> int:
        """Where the window of a history of ``total_events`` events starts (a multiple of B)."""
        over = total_events - self.max_tokens
        return 0 if over <= 0 else -(-over // self.slide_tokens) * self.slide_tokens

    def slid(self, before_events: int, after_events: int) -> bool:
        """Whether growing a history from ``before_events`` to ``after_events`` moved its
        window (what the slide counters count: one invalidation however far it moved)."""
        return self.start(after_events) != self.start(before_events)

    def check_suffix(self, suffix_tokens: int, what: str) -> None:
        """``SequenceTooLongError`` when a visit's ``suffix_tokens`` cannot fit the window."""
        if suffix_tokens > self.max_suffix_tokens:
            raise SequenceTooLongError(
                f"{what} holds {suffix_tokens} events; a visit adds at most "
                f"{self.max_suffix_tokens}: the model reads a window of max_seq_len "
                f"{self.max_tokens} events that slides in blocks of {self.slide_tokens}, and "
                "the visit's events must fit in it after the history's newest block")

    def prefix(self, store: HistoryStore, user_id: int, suffix_tokens: int,
               continues_at: int | None = None) -> VisitPrefix:
        """The stored part of the window a visit adding ``suffix_tokens`` events reads: its
        events (read-only views of the store's), start and cache identity, less the event it
        holds back under a time query from the next event (the module docstring).
        ``continues_at``: the time the visit goes on at (its first event's, else the request's),
        what a single stored event is computed for; None: that event's own time."""
        self.check_suffix(suffix_tokens, "the visit's suffix")
        history = store.get(user_id)
        if history.num_events == 0:
            raise InvalidInputError(f"user {user_id} has an empty history")
        start = self.start(history.num_events + suffix_tokens)
        assert start < history.num_events, "a suffix within max_suffix_tokens starts no window"
        end, after = history.num_events, None
        ts = history.timestamps
        if self.next_time_query and ts is not None:
            if end - start >= 2:
                end -= 1
                after = int(ts[end])
            else:
                after = int(ts[end - 1]) if continues_at is None else int(continues_at)
        pid = PrefixId(user_id, end - start,
                       continued(store.version_at(user_id, end, start), after))
        payload = PrefixPayload(pid, history.items[start:end],
                                None if ts is None else ts[start:end], start, after)
        return VisitPrefix(payload, history.items[end:],
                           None if ts is None else ts[end:history.num_events])

    @staticmethod
    def grown(store: HistoryStore, prefix: VisitPrefix, items: Sequence[int],
              timestamps: Sequence[int] | None) -> PrefixId | None:
        """The identity of ``prefix`` followed by its held event and a visit's events once
        they are stored, less the newest under a continuation time (whose K/V was computed for
        the request's time): the key the ranking pass's kept K/V is stored under, which is the
        next visit's prefix while the window holds. None for a visit that adds no events."""
        if not len(items):
            return None
        payload = prefix.payload
        pid, start = payload.pid, payload.window_start
        tied = payload.next_timestamp is not None
        keep = len(items) - int(tied)        # the visit's events the kept K/V covers
        ids = np.asarray(items, np.int64)
        ts = check_suffix_timestamps(payload.timestamps is not None, ids, timestamps)
        version = store.version_after(pid.user_id, start + pid.num_tokens + prefix.held,
                                      ids[:keep],
                                      None if ts is None else ts[:keep], start)
        if tied:
            assert ts is not None     # a timed history's (checked above)
            version = continued(version, int(ts[keep]))
        return PrefixId(pid.user_id, pid.num_tokens + prefix.held + keep, version)
