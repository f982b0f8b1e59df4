"""Layer 3 (tiering): the host-DRAM expander tier of one server.

Holds consumed prefixes demoted from the device pool so that the same user's next request
(a refresh or a next page, seconds to minutes later) reloads and extends the prefix instead of
recomputing it. Same arena/allocator/index as the device pool, in host memory (page-locked on
CUDA so reloads can be asynchronous), with its own byte budget, LRU and a TTL:

- ``put`` stores a copy (evicting expired, then least recently used, entries to fit); it refuses,
  counted, what cannot fit. A user's older entry is replaced; storing the ``pid`` already held
  copies nothing and only restarts its TTL (``refresh``).
- ``lookup`` returns the user's entry if not expired (the TTL counts from the latest store).
  Expiry is lazy: expired entries are dropped at ``begin``, ``acquire``, ``expire`` and when
  ``stats`` is read, so its figures count live entries only.
- ``acquire``/``release`` pin an entry while it is copied to the device (neither evicted nor
  expired under the copy) and make it the most recently used.
- ``begin``/``write``/``commit``/``abort`` store asynchronously (the ``Expander`` demotes on a side
  stream with them); ``put`` is the synchronous form.

Views returned by ``lookup`` alias the arena: valid until the next call that changes this tier.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from relaygr.errors import ConfigError, InvalidInputError
from relaygr.kvcache.index import Entry, EntryInfo, EntryState, PrefixId, Refusal
from relaygr.kvcache.pools import KVLayout
from relaygr.kvcache.store import Lookup, PagedStore, PendingEntry, TierStats
from relaygr.model import PrefixKV

Clock = Callable[[], float]


@dataclass(frozen=True)
class HostHit:
    """A host-tier entry: which prefix it covers, and a view of its data in host memory."""

    pid: PrefixId
    kv: PrefixKV


@dataclass(frozen=True)
class _Stored:
    """An expiry record: valid while the user's entry still has this serial and store time."""

    stored_s: float
    serial: int
    user_id: int


class HostKVTier:
    """Host-memory second tier with a byte budget, LRU and TTL (see the module docstring).

    Invariants: never over budget; a pinned entry is neither evicted nor expired; an expired
    entry is never returned.
    """

    def __init__(self, layout: KVLayout, budget_bytes: int, ttl_s: float, *,
                 page_tokens: int = 64, pin_memory: bool = False,
                 clock: Clock = time.monotonic) -> None:
        if not ttl_s > 0:
            raise ConfigError(f"ttl_s must be positive, got {ttl_s!r}")
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError("pin_memory needs CUDA (page-locked memory serves GPU copies)")
        self.store = PagedStore(layout, budget_bytes, page_tokens, "cpu", pin_memory)
        self.ttl_s = float(ttl_s)
        self.clock = clock
        # Store records in time order (the clock is monotonic): expiry pops from the front.
        self._stored: deque[_Stored] = deque()

    @property
    def layout(self) -> KVLayout:
        return self.store.layout

    @property
    def last_refusal(self) -> Refusal | None:
        return self.store.last_refusal

    def _expired(self, entry: Entry, now_s: float) -> bool:
        return entry.state is not EntryState.PENDING and now_s - entry.created_s >= self.ttl_s

    def _stamp(self, entry: Entry) -> None:
        entry.created_s = self.clock()
        self._stored.append(_Stored(entry.created_s, entry.serial, entry.pid.user_id))

    # ---- storing ---------------------------------------------------------------------------

    def put(self, pid: PrefixId, kv: PrefixKV) -> bool:
        """Store a copy of ``kv`` as ``pid`` (synchronous). False, counted, if it cannot fit."""
        if not isinstance(pid, PrefixId) or not isinstance(kv, PrefixKV):
            raise InvalidInputError("put takes a PrefixId and a PrefixKV")
        if kv.num_tokens != pid.num_tokens:
            raise InvalidInputError(f"prefix has {kv.num_tokens} tokens, {pid} says otherwise")
        self.store.layout.check(kv)
        existing = self.store.index.get(pid.user_id)
        if existing is not None and existing.pid == pid:
            self.refresh(pid)                    # already here (or being stored): no copy
            return True
        pending = self.begin(pid, timed=kv.has_timestamps)
        if pending is None:
            return False
        self.write(pending, kv)
        self.commit(pending)
        return True

    def refresh(self, pid: PrefixId) -> bool:
        """If exactly ``pid`` is stored (not PENDING), restart its TTL and make it the most
        recently used; returns whether it was."""
        entry = self.store.index.get(pid.user_id)
        if entry is None or entry.pid != pid or entry.state is EntryState.PENDING:
            return False
        self._stamp(entry)
        self.store.index.touch(entry)
        return True

    def begin(self, pid: PrefixId, *, timed: bool) -> PendingEntry | None:
        """Reserve space for ``pid`` (PENDING: invisible to ``lookup``). None when refused;
        ``CacheStateError`` when ``pid`` is already stored (use ``refresh``)."""
        if not isinstance(pid, PrefixId):
            raise InvalidInputError(f"expected a PrefixId, got {type(pid).__name__}")
        self.expire()
        admitted = self.store.admit(pid, timed, self.clock())
        return None if admitted is None else self.store.handle(admitted.entry)

    def write(self, pending: PendingEntry, kv: PrefixKV, start_token: int = 0, *,
              non_blocking: bool = False) -> None:
        """Copy ``kv`` (K, V, timestamps, last_hidden) into the reserved entry; see
        ``DeviceKVPool.write`` for the rules."""
        self.store.write(self.store.resolve(pending), kv, start_token, non_blocking)

    def commit(self, pending: PendingEntry) -> None:
        """PENDING -> IDLE: visible to ``lookup``, evictable, its TTL starts now."""
        entry = self.store.resolve(pending)
        self.store.require_complete(entry)
        self._stamp(entry)
        self.store.index.mark_idle(entry)

    def abort(self, pending: PendingEntry) -> None:
        self.store.drop(self.store.resolve(pending))

    # ---- reading ---------------------------------------------------------------------------

    def lookup(self, user_id: int) -> HostHit | None:
        """The user's stored, unexpired prefix (no side effects)."""
        entry = self.store.index.get(user_id)
        if entry is None or entry.state is EntryState.PENDING \
                or self._expired(entry, self.clock()):
            return None
        return HostHit(entry.pid, self.store.view(entry))

    def info(self, user_id: int) -> EntryInfo | None:
        """The user's entry in any state, expired or not (for tests and metrics)."""
        entry = self.store.index.get(user_id)
        return None if entry is None else EntryInfo.of(entry)

    def acquire(self, pid: PrefixId, *, counted: bool = True) -> PrefixKV | None:
        """Pin the unexpired entry of exactly ``pid`` and return its view (until ``release``).
        The lookup is counted (``TierStats``) unless ``counted`` is False: the expander's pin
        of a copy it reloads is no request's lookup (the engine counts those,
        ``count_lookup``)."""
        if not isinstance(pid, PrefixId):
            raise InvalidInputError(f"expected a PrefixId, got {type(pid).__name__}")
        self.expire()
        entry = self.store.index.get(pid.user_id)
        if entry is not None and entry.pid == pid and self._expired(entry, self.clock()):
            if counted:                          # pinned by another copy when its TTL ran out
                self.store.count_lookup(Lookup.MISS)
            return None
        entry = self.store.match(pid, counted)
        if entry is None:
            return None
        self.store.index.pin(entry)
        return self.store.view(entry)

    def release(self, pid: PrefixId) -> None:
        self.store.index.unpin(self.store.in_use_entry(pid))

    def count_lookup(self, found: Lookup) -> None:
        """Count one lookup that found ``found`` (``TierStats``)."""
        self.store.count_lookup(found)

    def expire(self) -> int:
        """Drop every expired entry that is not pinned; returns how many."""
        now_s = self.clock()
        kept: list[_Stored] = []
        dropped = 0
        while self._stored and now_s - self._stored[0].stored_s >= self.ttl_s:
            record = self._stored.popleft()
            entry = self.store.index.get(record.user_id)
            if entry is None or entry.serial != record.serial \
                    or entry.created_s != record.stored_s:
                continue                          # superseded record
            if entry.pins:
                kept.append(record)               # expires when no longer pinned
                continue
            self.store.index.remove(entry)
            dropped += 1
        self._stored.extendleft(reversed(kept))
        self.store.counters.expired += dropped
        return dropped

    # ---- reporting -------------------------------------------------------------------------

    @property
    def stats(self) -> TierStats:
        """A snapshot of live entries: expiry is lazy (at ``begin``, ``acquire``,
        ``expire``), so the snapshot expires first; otherwise its bytes and entries would
        count copies past their TTL, which no lookup returns. An expired entry still pinned
        by a copy counts until it is released."""
        self.expire()
        return self.store.stats()

    def check_integrity(self) -> None:
        self.store.check_integrity()
        live = {(r.user_id, r.serial, r.stored_s) for r in self._stored}
        for entry in self.store.index.entries():
            if entry.state is EntryState.READY:
                raise AssertionError(f"host entry {entry.pid} is READY (the host has no leases)")
            if entry.state is EntryState.IDLE and \
                    (entry.pid.user_id, entry.serial, entry.created_s) not in live:
                raise AssertionError(f"host entry {entry.pid} has no expiry record")
