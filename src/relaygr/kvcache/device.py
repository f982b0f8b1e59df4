"""Layer 3 (tiering): the device KV pool of one ranking instance.

Lifecycle of a pre-inferred prefix (the relay's baton)::

    pending = pool.begin(pid, timed=...)     # PENDING, pages reserved (None: admission refused)
    pool.write(pending, kv)                  # one or more copies, contiguous from token 0
    pool.commit(pending, kv.last_hidden)     # READY, leased for lease_s; waiters woken
    kv = pool.acquire(pid)                   # zero-copy view, pinned (in use)
    pool.release(pid)                        # IDLE (lease consumed), evictable, most recent

A ranking request that finds its prefix PENDING awaits ``pool.wait_settled(pid)``: woken by
``commit`` (True) or ``abort`` (False: fall back to the full pass). Leases end lazily (at
``begin``) or via ``expire_leases``. Views returned by ``acquire`` alias the arena and are valid
only until the matching ``release``.

The arena is allocated once at construction within ``budget_bytes``; nothing on these paths
allocates device memory. Bookkeeping runs on the event-loop thread (no locks); ``write`` and
``written_view`` may also run on the instance's compute thread (see the package docstring).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from relaygr.errors import ConfigError, IncompatiblePrefixError, InvalidInputError
from relaygr.kvcache.index import EntryInfo, EntryState, PrefixId, Refusal
from relaygr.kvcache.pools import KVLayout
from relaygr.kvcache.store import Lookup, PagedStore, PendingEntry, TierStats
from relaygr.model import PrefixKV

Clock = Callable[[], float]


@dataclass
class _Waiters:
    """Settlement of one PENDING entry: an event set once, and whether it committed."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    committed: bool = False


class DeviceKVPool:
    """Preallocated, byte-budgeted KV cache on one device (see the module docstring).

    Invariants: the arena never exceeds ``budget_bytes``; PENDING, READY and in-use entries are
    never evicted (admission refuses instead); each entry is one contiguous run of pages.
    """

    def __init__(self, layout: KVLayout, budget_bytes: int, *, page_tokens: int = 64,
                 lease_s: float = 2.0, device: torch.device | str = "cpu",
                 clock: Clock = time.monotonic) -> None:
        if not lease_s > 0:
            raise ConfigError(f"lease_s must be positive, got {lease_s!r}")
        self.store = PagedStore(layout, budget_bytes, page_tokens, device, pin_memory=False)
        self.lease_s = float(lease_s)
        self.clock = clock
        self._waiters: dict[int, _Waiters] = {}   # serial of a PENDING entry -> its waiters

    @property
    def layout(self) -> KVLayout:
        return self.store.layout

    @property
    def device(self) -> torch.device:
        return self.store.arena.device

    @property
    def page_tokens(self) -> int:
        return self.store.arena.page_tokens

    @property
    def last_refusal(self) -> Refusal | None:
        """Why the latest ``begin`` returned None (None after a successful one)."""
        return self.store.last_refusal

    # ---- producing an entry ----------------------------------------------------------------

    def begin(self, pid: PrefixId, *, timed: bool) -> PendingEntry | None:
        """Reserve space for ``pid`` as a PENDING entry.

        Ends due leases, then frees the user's older entry (unless PENDING or in use) and IDLE
        entries in LRU order as needed. Returns None, counted by reason in ``stats`` and changing
        nothing, when the prefix cannot fit without evicting a PENDING, READY or in-use entry
        (the user's own older entry is replaced even when READY: a newer version supersedes it).
        Raises ``CacheStateError`` if ``pid`` itself is already cached or pending.
        """
        if not isinstance(pid, PrefixId):
            raise InvalidInputError(f"expected a PrefixId, got {type(pid).__name__}")
        self.expire_leases()
        admitted = self.store.admit(pid, timed, self.clock())
        return None if admitted is None else self.store.handle(admitted.entry)

    def write(self, pending: PendingEntry, kv: PrefixKV, start_token: int = 0, *,
              non_blocking: bool = False) -> None:
        """Copy ``kv`` (K, V, timestamps; any device) to tokens ``start_token..`` of the entry,
        and ``kv.last_hidden`` to its hidden slot (the latest write's hidden is the entry's).

        Writes must leave no gap (``start_token`` <= tokens written so far) and stay within
        ``pid.num_tokens``. ``non_blocking`` is for pinned host sources on a side stream (the
        caller then synchronises before reading or committing; see ``Expander``).
        """
        self.store.write(self.store.resolve(pending), kv, start_token, non_blocking)

    def written_view(self, pending: PendingEntry, num_tokens: int) -> PrefixKV:
        """The first ``num_tokens`` written tokens as a zero-copy ``PrefixKV`` (hidden: the
        latest write's): the ``past`` to extend with ``HSTU.prefill(new_items, past=...)``
        before writing the computed tail at token ``num_tokens``."""
        entry = self.store.resolve(pending)
        if not isinstance(num_tokens, int) or not 0 < num_tokens <= entry.written_tokens:
            raise InvalidInputError(
                f"{num_tokens} tokens requested, {entry.written_tokens} written for {entry.pid}")
        return self.store.view(entry, num_tokens)

    def commit(self, pending: PendingEntry, last_hidden: Tensor | None = None, *,
               lease: bool = True) -> None:
        """PENDING -> READY, leased for ``lease_s``; wakes every waiter with True.

        Every token must have been written. ``last_hidden`` (the user representation after the
        last prefix token) replaces the latest write's when given. ``lease=False`` commits
        straight to IDLE (most recently used): for a prefix cached after its ranking already
        ran (the reactive mode), which no request is waiting to consume.
        """
        entry = self.store.resolve(pending)
        self.store.require_complete(entry)
        if last_hidden is not None:
            if not isinstance(last_hidden, Tensor):
                raise IncompatiblePrefixError("last_hidden must be a tensor")
            self.store.arena.write_hidden(entry.run.start, last_hidden)
        if lease:
            self.store.index.mark_ready(entry, self.clock() + self.lease_s)
        else:
            self.store.index.mark_idle(entry)
        self._settle(entry.serial, committed=True)

    def abort(self, pending: PendingEntry) -> None:
        """Drop a PENDING entry (its computation failed); wakes every waiter with False."""
        entry = self.store.resolve(pending)
        self.store.drop(entry)
        self._settle(entry.serial, committed=False)

    def _settle(self, serial: int, committed: bool) -> None:
        waiters = self._waiters.pop(serial, None)
        if waiters is not None:
            waiters.committed = committed
            waiters.event.set()

    async def wait_settled(self, pid: PrefixId) -> bool:
        """Wait until ``pid`` is no longer PENDING: True if it was committed (then ``acquire``
        it; it is leased), False if it was aborted or is not here at all."""
        if not isinstance(pid, PrefixId):
            raise InvalidInputError(f"expected a PrefixId, got {type(pid).__name__}")
        entry = self.store.index.get(pid.user_id)
        if entry is None or entry.pid != pid:
            return False
        if entry.state is not EntryState.PENDING:
            return True
        waiters = self._waiters.setdefault(entry.serial, _Waiters())
        await waiters.event.wait()
        return waiters.committed

    # ---- consuming an entry ----------------------------------------------------------------

    def lookup(self, user_id: int) -> EntryInfo | None:
        """The user's entry, whatever its version or state; no side effects."""
        entry = self.store.index.get(user_id)
        return None if entry is None else EntryInfo.of(entry)

    def acquire(self, pid: PrefixId, *, counted: bool = True) -> PrefixKV | None:
        """Pin the READY or IDLE entry of exactly ``pid`` and return a zero-copy view of it
        (valid until ``release``). None if absent, PENDING or another version. The lookup is
        counted (``TierStats``) unless ``counted`` is False: for a caller that counts the
        request's outcome itself (``count_lookup``), once it is known."""
        entry = self.store.match(pid, counted)
        if entry is None:
            return None
        self.store.index.pin(entry)
        return self.store.view(entry)

    def count_lookup(self, found: Lookup) -> None:
        """Count one lookup that found ``found`` (``TierStats``)."""
        self.store.count_lookup(found)

    def lease(self, pid: PrefixId) -> bool:
        """Lease the complete entry of exactly ``pid`` for ``lease_s`` from now (an IDLE one
        becomes READY: not evictable until its ranking consumes it or the lease ends); False,
        changing nothing, if it is absent, PENDING or another version. For a pre-infer signal
        that finds its prefix already here: without a lease, an admission between the
        request's two legs could evict it."""
        entry = self.store.index.get(pid.user_id)
        if entry is None or entry.pid != pid or entry.state is EntryState.PENDING:
            return False
        self.store.index.lease(entry, self.clock() + self.lease_s)
        return True

    def end_lease(self, pid: PrefixId) -> bool:
        """End the lease of exactly ``pid`` now (READY -> IDLE, evictable): its ranking leg will
        not come. False, changing nothing, if it is absent, not READY, another version or in
        use (its ranking is under way)."""
        entry = self.store.index.get(pid.user_id)
        if entry is None or entry.pid != pid or entry.state is not EntryState.READY \
                or entry.pins:
            return False
        self.store.index.mark_idle(entry)
        return True

    def view_in_use(self, pid: PrefixId) -> PrefixKV:
        """The view of an entry the caller holds (``acquire``d, not yet released)."""
        return self.store.view(self.store.in_use_entry(pid))

    def release(self, pid: PrefixId) -> None:
        """Unpin after ranking: the last release turns READY into IDLE (lease consumed) and makes
        the entry the most recently used, unless a lease was granted since the entry was pinned
        (``lease``: another ranking leg is coming), which keeps it READY (``CacheIndex.unpin``)."""
        self.store.index.unpin(self.store.in_use_entry(pid))

    def discard(self, pid: PrefixId) -> bool:
        """Free exactly ``pid`` now if it is complete and nobody holds it (IDLE, unpinned):
        for systems that must not reuse a prefix beyond the request it was computed for.
        Returns whether it was freed; anything else is left as it was."""
        entry = self.store.index.get(pid.user_id)
        if entry is None or entry.pid != pid or not entry.evictable:
            return False
        self.store.index.remove(entry)
        return True

    def expire_leases(self) -> int:
        """READY entries past their lease (and not in use) become IDLE; returns how many."""
        expired = self.store.index.expire_leases(self.clock())
        self.store.counters.expired += len(expired)
        return len(expired)

    # ---- reporting -------------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self.store.arena.budget_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of reserved pages, O(1) (for per-request admission decisions)."""
        return self.store.used_bytes

    @property
    def unevictable_bytes(self) -> int:
        """Bytes held by PENDING, READY and in-use entries, O(1): the footprint the trigger
        bounds (IDLE entries are reclaimable on demand)."""
        return self.store.unevictable_bytes

    @property
    def stats(self) -> TierStats:
        """A full snapshot (O(entries)); use the byte properties on hot paths."""
        return self.store.stats()

    def check_integrity(self) -> None:
        self.store.check_integrity()
        pending = {e.serial for e in self.store.index.entries() if e.state is EntryState.PENDING}
        stray = set(self._waiters) - pending
        if stray:
            raise AssertionError(f"waiters for settled entries {sorted(stray)}")
