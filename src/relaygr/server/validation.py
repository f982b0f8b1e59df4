"""Checks of a parsed request against the served model, the user's history and the limits.

The schema (``relaygr.server.schemas``) has already fixed types and static bounds; this layer
checks what depends on state: the user exists, item ids are in the model's catalogue, a visit's
own events fit the model's history window (``cascade.window``: the history itself may be any
length, the model reads its newest window), timestamps match the user's history (timed or not,
in time order) and, for a user the request creates, the served model (timed exactly when the
model reads time), and counts are within the configured limits. Every check runs before the
backend is called and raises a typed ``InvalidInputError`` whose message names the field and the
limit, so a rejected request changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.history_checks import check_expected
from relaygr.cascade.store import HistorySnapshot, HistoryStore
from relaygr.cascade.window import HistoryWindow
from relaygr.errors import (
    EmptyInputError,
    InvalidInputError,
    ItemOutOfRangeError,
    TimestampError,
    UnknownUserError,
)
from relaygr.model import HSTUConfig
from relaygr.server.config import ServerConfig
from relaygr.server.schemas import EventsRequest, PrefillRequest, VisitFields


class RequestValidator:
    """Stateful checks of one request (see the module docstring). Reads, never writes."""

    def __init__(self, model: HSTUConfig, system: SystemConfig, server: ServerConfig,
                 store: HistoryStore, timed: bool) -> None:
        """``timed``: whether the served model reads time (a user it ranks without timestamps
        would be scored by other semantics than it was trained with, and one with them by a
        bias it never learned)."""
        self.model = model
        self.timed = timed
        self.system = system
        self.server = server
        self.store = store
        self.window = HistoryWindow.for_model(model, system)

    # ---- per endpoint ------------------------------------------------------------------------
    def visit(self, request: VisitFields) -> HistorySnapshot:
        """A visit's user, its ``expected_events`` (409 before anything is ranked; the store
        checks it again with the append), recent events and request time; returns the user's
        history."""
        history = self.history(request.user_id)
        check_expected(request.user_id, request.expected_events, history.num_events)
        self._count("recent_items", request.recent_items, self.server.max_events_per_request)
        self._items("recent_items", request.recent_items)
        if request.recent_items or request.recent_timestamps:
            self._timestamps(history, "recent_items", request.recent_items,
                             "recent_timestamps", request.recent_timestamps)
        if request.request_ts is not None and history.timestamps is None:
            raise TimestampError(f"user {request.user_id}'s history is untimed; "
                                 "request_ts must be omitted")
        self.window.check_suffix(len(request.recent_items), "recent_items")
        return history

    def num_candidates(self, num_candidates: int | None) -> None:
        """``/v1/recommend``'s: its candidates are what retrieval returns, so at most
        ``retrieval_k`` of them (and ``max_candidates``)."""
        limit = min(self.system.stages.retrieval_k, self.server.max_candidates)
        if num_candidates is not None and num_candidates > limit:
            raise InvalidInputError(f"num_candidates is {num_candidates}; this server ranks at "
                                    f"most {limit} retrieved candidates")

    def candidates(self, candidates: Sequence[int]) -> None:
        if not candidates:
            raise EmptyInputError("candidates is empty; a ranking request needs at least one")
        self._count("candidates", candidates, self.server.max_candidates)
        self._items("candidates", candidates)

    def prefill(self, request: PrefillRequest) -> None:
        """``num_candidates`` announces the ``/v1/rank`` that follows (the trigger estimates its
        ranking pass from it; it reserves nothing and runs no retrieval), whose candidates come
        from the caller's own stages: so its limit is that request's, ``max_candidates``, not
        ``retrieval_k``. A caller that may rank 2,000 candidates can announce them."""
        self.history(request.user_id)
        self.window.check_suffix(request.suffix_tokens, "suffix_tokens")
        limit = self.server.max_candidates
        if request.num_candidates is not None and request.num_candidates > limit:
            raise InvalidInputError(f"num_candidates is {request.num_candidates}; a /v1/rank "
                                    f"request carries at most {limit} candidates")

    def events(self, request: EventsRequest) -> None:
        """Appends are kept whole at any history length (the model reads the newest window).
        A user the request creates is timed exactly when the model is. ``expected_events``
        is checked before the timestamps (a retry's are stale once its append was applied)."""
        self._count("items", request.items, self.server.max_events_per_request)
        self._items("items", request.items)
        if request.user_id not in self.store:
            check_expected(request.user_id, request.expected_events, 0)
            self._new_user_timestamps(request.items, request.timestamps)
            return
        history = self.store.get(request.user_id)
        check_expected(request.user_id, request.expected_events, history.num_events)
        self._timestamps(history, "items", request.items, "timestamps", request.timestamps)

    # ---- shared checks -----------------------------------------------------------------------
    def history(self, user_id: int) -> HistorySnapshot:
        if user_id not in self.store:
            raise UnknownUserError(f"user {user_id} has no history on this server")
        history = self.store.get(user_id)
        if history.num_events == 0:
            raise EmptyInputError(f"user {user_id} has an empty history")
        return history

    def _count(self, name: str, values: Sequence[int], limit: int) -> None:
        if len(values) > limit:
            raise InvalidInputError(f"{name} holds {len(values)} entries; this server accepts "
                                    f"at most {limit}")

    def _items(self, name: str, items: Sequence[int]) -> None:
        if not items:
            return
        low, high = min(items), max(items)
        if low < 1 or high > self.model.num_items:
            bad = low if low < 1 else high
            raise ItemOutOfRangeError(f"{name} holds item id {bad}; this model's item ids are "
                                      f"1..{self.model.num_items}")

    def _timestamps(self, history: HistorySnapshot, items_name: str, items: Sequence[int],
                    ts_name: str, timestamps: Sequence[int] | None) -> None:
        user = history.user_id
        if history.timestamps is None:
            if timestamps is not None:
                raise TimestampError(f"user {user}'s history is untimed; {ts_name} must be "
                                     "omitted")
            return
        if timestamps is None:
            raise TimestampError(f"user {user}'s history is timed; {ts_name} must give one "
                                 f"timestamp per entry of {items_name}")
        self._check_pairs(items_name, items, ts_name, timestamps)
        last = int(history.timestamps[-1]) if history.num_events else None
        if timestamps and last is not None and timestamps[0] < last:
            raise TimestampError(f"{ts_name} starts at {timestamps[0]}, before user {user}'s "
                                 f"latest event at {last}; events are appended in time order")

    def _new_user_timestamps(self, items: Sequence[int], timestamps: Sequence[int] | None
                             ) -> None:
        if not self.timed:
            if timestamps is not None:
                raise TimestampError("this model is untimed; a new user's timestamps must be "
                                     "omitted")
            return
        if timestamps is None:
            raise TimestampError("this model reads time; a new user's timestamps must give "
                                 "one timestamp per entry of items")
        self._check_pairs("items", items, "timestamps", timestamps)

    @staticmethod
    def _check_pairs(items_name: str, items: Sequence[int], ts_name: str,
                     timestamps: Sequence[int]) -> None:
        if len(timestamps) != len(items):
            raise TimestampError(f"{items_name} has {len(items)} entries but {ts_name} has "
                                 f"{len(timestamps)}")
        if len(timestamps) > 1 and bool(np.any(np.diff(np.asarray(timestamps)) < 0)):
            raise TimestampError(f"{ts_name} must be non-decreasing (events in time order)")
