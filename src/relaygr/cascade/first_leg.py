"""The first leg of a request's path (``cascade.request_path``): prefix, route, pre-infer signal.

``FirstLegPath`` holds a request path's parts and the state its two legs share, and sends a
request's first leg: the window's prefix of the user's history (``cascade.window``), the fleet's
route and its pre-infer signal (unless shed), and the signal's outcome. The signal is advisory:
one that raised is lost (counted), and ranking computes the prefix. ``prefill`` sends the signal
alone and remembers its route for the user's ranking leg (``RequestPath.rank_candidates``), until
the pre-infer's lease is over or a newer first leg of the user is sent.
``cascade.request_path.RequestPath`` adds the ranking leg.

``Leg`` is a request between its two legs; ``Suffix``, the visit's events as the ranking leg
takes them.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.fleet import FirstLeg, Fleet
from relaygr.cascade.modes import Mode, spec_for
from relaygr.cascade.stages import EarlierStages
from relaygr.cascade.store import HistoryStore
from relaygr.cascade.visit import SystemCounters, Visit
from relaygr.cascade.window import HistoryWindow, VisitPrefix
from relaygr.engine.types import FAILED, PrefixSpec, PreinferResult
from relaygr.engine.versions import continued
from relaygr.errors import NoHealthyInstanceError, PreinferDisabledError
from relaygr.kvcache import PrefixId

# Prefill signals whose ranking leg has not come yet (within their lease); a caller that never
# ranks costs at most this much.
_MAX_REMEMBERED_DECISIONS = 100_000
# Pre-infer signals that raised, logged with their traceback; the rest are counted only.
_LOGGED_LOST_PREINFERS = 5

log = logging.getLogger("relaygr.cascade.request_path")


@dataclass(frozen=True)
class Suffix:
    """A visit's events as the ranking leg takes them (after the stored event the window's
    prefix held back, if any), and the identity of the prefix they grow (``HistoryWindow.
    grown``: the key the ranked K/V is kept under)."""

    items: Tensor | None
    timestamps: Tensor | None
    grown: PrefixId | None


@dataclass(frozen=True)
class _Prefilled:
    """A pre-infer signal sent alone (``RequestPath.prefill``), remembered until its ranking
    leg comes: that leg is the same request (``request_id``) and follows ``first``. Until
    ``expires_s`` (the event loop's time) only: the pre-infer's lease, after which its prefix is
    no longer kept for that leg (and a breaker's probe reserved for it has lapsed)."""

    request_id: str
    first: FirstLeg
    expires_s: float


@dataclass
class Leg:
    """A request between its two legs: the routed prefix, the first leg as sent, and the
    visit's suffix once prepared (``RequestPath._suffix``)."""

    visit: Visit
    request_id: str
    spec: PrefixSpec
    window_prefix: VisitPrefix     # the spec's events and the stored ones held back after it
    history_items: np.ndarray
    num_candidates: int
    sent: FirstLeg | Awaitable[FirstLeg]
    suffix: Suffix | None = None


class FirstLegPath:
    """A request path's parts, its shared state and its first leg (see the module docstring);
    ``RequestPath`` is the whole path. One event loop drives it."""

    def __init__(self, fleet: Fleet, config: SystemConfig, store: HistoryStore,
                 window: HistoryWindow, stages: EarlierStages) -> None:
        self.fleet = fleet
        self.config = config
        self.store = store
        self.window = window
        self.stages = stages
        self.preinfers = spec_for(Mode.parse(config.mode)).preinfer
        self.counters = SystemCounters()
        # user -> its prefill signal, which its ranking leg follows, oldest first: dropped when
        # that leg comes, when the user's next first leg is sent, or once its lease is over
        # (bounded too: oldest dropped)
        self._decisions: OrderedDict[int, _Prefilled] = OrderedDict()

    @property
    def remembered_prefills(self) -> int:
        """Pre-infer signals (``prefill``) whose ranking leg has not come yet, as of the latest
        request (expired ones are dropped as each request begins, and never followed)."""
        return len(self._decisions)

    async def prefill(self, user_id: int, suffix_tokens: int = 0,
                      num_candidates: int | None = None) -> tuple[str, PreinferResult]:
        """The pre-infer signal alone (for callers that run their own earlier stages). The
        routing decision is remembered so the user's next ``rank_candidates`` follows it.
        ``PreinferDisabledError`` in a mode without pre-inference."""
        if not self.preinfers:
            raise PreinferDisabledError(f"mode {self.config.mode!r} does not pre-infer; "
                                        "send /v1/rank alone, or serve a relay mode")
        leg = self._first_leg(Visit(user_id, num_candidates=num_candidates), send=True,
                              suffix_tokens=suffix_tokens)
        first = await self._first(leg)
        if first.route is not None:
            expires_s = asyncio.get_running_loop().time() + self.config.instance.lease_s
            self._decisions[user_id] = _Prefilled(leg.request_id, first, expires_s)
            self._decisions.move_to_end(user_id)
            while len(self._decisions) > _MAX_REMEMBERED_DECISIONS:
                self._decisions.popitem(last=False)
        result = await self._outcome(first)
        if result is None or first.instance is None:
            raise NoHealthyInstanceError("the pre-infer signal found no live ranking instance")
        return first.instance, result

    # ---- the first leg -----------------------------------------------------------------------
    def _prefix_spec(self, user_id: int, suffix_tokens: int, continues_at: int | None = None
                     ) -> tuple[PrefixSpec, VisitPrefix]:
        """The window's prefix a visit adding ``suffix_tokens`` events (going on at
        ``continues_at``) reads (``cascade.window``): as a spec, and with the events it holds
        back."""
        split = self.window.prefix(self.store, user_id, suffix_tokens, continues_at)
        prefix = split.payload
        ts = None if prefix.timestamps is None else torch.tensor(prefix.timestamps)
        start = prefix.window_start

        def version_at(n: int) -> int:
            return continued(self.store.version_at(user_id, start + n, start),
                             prefix.continuation_at(n))

        spec = PrefixSpec(prefix.pid, torch.tensor(prefix.items), ts, version_at, start,
                          prefix.next_timestamp)
        return spec, split

    def _first_leg(self, visit: Visit, send: bool, suffix_tokens: int | None = None,
                   request_id: str | None = None) -> Leg:
        """The request's first leg (``request_id``: the request's, when it began with a
        ``prefill``)."""
        # a newer first leg of the user: a prefill remembered before is no longer followed
        self._decisions.pop(visit.user_id, None)
        self._forget_expired(asyncio.get_running_loop().time())
        s = len(visit.recent_items) if suffix_tokens is None else suffix_tokens
        continues_at = visit.recent_timestamps[0] if visit.recent_timestamps \
            else visit.request_ts
        spec, split = self._prefix_spec(visit.user_id, s, continues_at)
        history_items = self.store.get(visit.user_id).items       # what retrieval excludes
        n_cand = visit.num_candidates or self.config.stages.num_candidates
        request_id = request_id or uuid.uuid4().hex
        sent = self.fleet.preinfer(request_id, visit.user_id, spec, s + split.held, n_cand,
                                   send and self.preinfers)
        if isinstance(sent, FirstLeg):      # decided at once (counted now, as it was shed now)
            self._count_first(sent)
        return Leg(visit, request_id, spec, split, history_items, n_cand, sent)

    def _forget_expired(self, now: float) -> None:
        """Drop remembered prefills whose lease is over (the oldest first: in expiry order)."""
        while self._decisions:
            user, oldest = next(iter(self._decisions.items()))
            if oldest.expires_s > now:
                return
            del self._decisions[user]

    async def _first(self, leg: Leg) -> FirstLeg:
        """The first leg's outcome (awaited once: across Ray it comes with the reply). The
        signal is advisory: one that raised is lost, and ranking computes the prefix."""
        if not isinstance(leg.sent, FirstLeg):
            try:
                leg.sent = await leg.sent
            except AssertionError:
                raise
            except Exception:
                self._log_lost(leg.visit.user_id)
                leg.sent = FirstLeg(None, lost=True)
            self._count_first(leg.sent)
        return leg.sent

    async def _outcome(self, first: FirstLeg) -> PreinferResult | None:
        """The pre-infer's outcome (an instance in another process reports it later): one
        that raised counts as lost and reads ``failed``; the request goes on without it."""
        if inspect.isawaitable(first.result):
            try:
                first.result = await first.result
            except AssertionError:
                raise
            except Exception:
                self.counters.lost_preinfer += 1
                self._log_lost(None)
                first.result, first.lost = FAILED, True
        return first.result

    def _log_lost(self, user_id: int | None) -> None:
        if self.counters.lost_preinfer < _LOGGED_LOST_PREINFERS:
            log.warning("a pre-infer signal%s raised; ranking computes the prefix in full",
                        "" if user_id is None else f" of user {user_id}", exc_info=True)

    def _count_first(self, first: FirstLeg) -> None:
        self.counters.shed_preinfer += int(first.shed)
        self.counters.lost_preinfer += int(first.lost)
