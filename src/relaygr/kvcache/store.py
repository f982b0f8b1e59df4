"""Layer 3 (tiering), shared part: one arena + allocator + index, and the checks every tier needs.

``PagedStore`` is what the device pool and the host expander are each built on. It validates
caller input (typed errors, no state change on rejection), resolves pending handles, copies data
into reserved pages, hands out views and keeps the counters both tiers report in ``TierStats``.
The policies that differ (leases and waiting on the device; TTL on the host) live in the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from relaygr.errors import CacheStateError, InvalidInputError
from relaygr.kvcache.allocator import RunAllocator
from relaygr.kvcache.index import (
    Admitted,
    CacheIndex,
    Entry,
    EntryState,
    PrefixId,
    Refusal,
)
from relaygr.kvcache.integrity import require
from relaygr.kvcache.pools import KVArena, KVLayout
from relaygr.model import PrefixKV


@dataclass(frozen=True)
class PendingEntry:
    """Handle to a PENDING entry, returned by ``begin``; valid until its commit or abort."""

    pid: PrefixId
    timed: bool
    serial: int


class Lookup(Enum):
    """What one lookup of a prefix found in a tier: the counters ``hits``, ``misses`` and
    ``stale_misses`` of ``TierStats``."""

    HIT = "hit"                 # the entry of exactly this prefix, complete
    MISS = "miss"               # nothing of this user, or its entry still PENDING
    STALE_MISS = "stale_miss"   # an entry of this user for another prefix (other events)


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier's occupancy and counters.

    ``used_bytes`` counts reserved pages (whole pages, at ``page_bytes`` each);
    ``unevictable_bytes`` the part held by PENDING, READY or in-use entries, which admission
    cannot reclaim (the footprint the trigger bounds). ``hits``, ``misses`` and
    ``stale_misses`` count lookups (``Lookup``), each once: an ``acquire`` counts its own
    unless told not to, and a caller that decides a request's outcome only later (the engine:
    one per ranking request, whatever it waited for or reloaded) counts it with
    ``count_lookup``.
    """

    budget_bytes: int
    arena_bytes: int
    page_bytes: int
    num_pages: int
    used_bytes: int
    unevictable_bytes: int
    free_pages: int
    largest_free_run_pages: int
    pending: int
    ready: int
    idle: int
    in_use: int
    admitted: int
    evictions: int
    replaced: int
    aborted: int
    expired: int
    hits: int
    misses: int
    stale_misses: int
    refusals: dict[Refusal, int] = field(default_factory=dict)

    @property
    def admission_failures(self) -> int:
        return sum(self.refusals.values())

    @property
    def entries(self) -> int:
        return self.pending + self.ready + self.idle


@dataclass
class _Counters:
    admitted: int = 0
    evictions: int = 0
    replaced: int = 0
    aborted: int = 0
    expired: int = 0
    hits: int = 0
    misses: int = 0
    stale_misses: int = 0
    refusals: dict[Refusal, int] = field(default_factory=lambda: {r: 0 for r in Refusal})


class PagedStore:
    """Arena + allocator + index of one tier, with validated data movement."""

    def __init__(self, layout: KVLayout, budget_bytes: int, page_tokens: int,
                 device: torch.device | str, pin_memory: bool) -> None:
        self.layout = layout
        self.arena = KVArena(layout, budget_bytes, page_tokens, device, pin_memory)
        self.allocator = RunAllocator(self.arena.num_pages)
        self.index = CacheIndex(self.allocator, page_tokens)
        self.counters = _Counters()
        self.last_refusal: Refusal | None = None

    # ---- admission and pending entries -----------------------------------------------------

    def admit(self, pid: PrefixId, timed: bool, now_s: float) -> Admitted | None:
        """Reserve pages for ``pid`` (None, counted, when it cannot be done cleanly)."""
        if not isinstance(timed, bool):
            raise InvalidInputError(f"timed must be a bool, got {timed!r}")
        outcome = self.index.admit(pid, timed, now_s)
        if not isinstance(outcome, Admitted):
            self.counters.refusals[outcome.reason] += 1
            self.last_refusal = outcome.reason
            return None
        self.last_refusal = None
        self.counters.admitted += 1
        self.counters.evictions += len(outcome.victims)
        self.counters.replaced += outcome.replaced is not None
        return outcome

    def handle(self, entry: Entry) -> PendingEntry:
        return PendingEntry(entry.pid, entry.timed, entry.serial)

    def resolve(self, pending: PendingEntry) -> Entry:
        """The PENDING entry behind ``pending``, or ``CacheStateError``."""
        if not isinstance(pending, PendingEntry):
            raise InvalidInputError(f"expected a PendingEntry, got {type(pending).__name__}")
        entry = self.index.get(pending.pid.user_id)
        if entry is None or entry.serial != pending.serial:
            raise CacheStateError(f"{pending.pid} is not pending here (unknown or settled)")
        assert entry.state is EntryState.PENDING, "a live serial must be PENDING"
        return entry

    def write(self, entry: Entry, kv: PrefixKV, start_token: int,
              non_blocking: bool = False) -> None:
        """Copy ``kv`` to tokens ``start_token..`` of a PENDING entry, with no gap before it."""
        if not isinstance(kv, PrefixKV):
            raise InvalidInputError(f"expected a PrefixKV, got {type(kv).__name__}")
        self.layout.check(kv)
        if not isinstance(start_token, int) or start_token < 0:
            raise InvalidInputError(f"start_token must be a non-negative int, got {start_token!r}")
        if start_token > entry.written_tokens:
            raise InvalidInputError(
                f"write at token {start_token} would leave a gap: {entry.pid} has "
                f"{entry.written_tokens} tokens written")
        end = start_token + kv.num_tokens
        if end > entry.pid.num_tokens:
            raise InvalidInputError(
                f"write of tokens {start_token}..{end - 1} overflows {entry.pid}")
        self.arena.write(entry.run.start, kv, start_token, entry.timed, non_blocking)
        if end >= entry.written_tokens:       # this write ends the written tokens
            entry.next_ts = kv.next_timestamp
        entry.written_tokens = max(entry.written_tokens, end)

    def require_complete(self, entry: Entry) -> None:
        if entry.written_tokens != entry.pid.num_tokens:
            raise CacheStateError(
                f"{entry.pid}: only {entry.written_tokens} of {entry.pid.num_tokens} tokens "
                "written")

    def view(self, entry: Entry, num_tokens: int | None = None) -> PrefixKV:
        """Zero-copy view of an entry's first ``num_tokens`` (default all) tokens, with their
        continuation time under time_query="next": the entry's own for all its written tokens,
        else the next token's."""
        n = entry.pid.num_tokens if num_tokens is None else num_tokens
        next_ts = entry.next_ts
        if next_ts is not None and n < entry.written_tokens:
            next_ts = self.arena.timestamp(entry.run.start, n)
        return self.arena.view(entry.run.start, n, entry.timed, next_ts)

    def drop(self, entry: Entry) -> None:
        """Abort a PENDING entry: free its pages, leave no trace but the counter."""
        self.index.remove(entry)
        self.counters.aborted += 1

    # ---- exact lookups ---------------------------------------------------------------------

    def match(self, pid: PrefixId, counted: bool = True) -> Entry | None:
        """The complete entry for exactly ``pid``; when ``counted``, the lookup is counted
        as a hit, miss or stale miss (``Lookup``)."""
        if not isinstance(pid, PrefixId):
            raise InvalidInputError(f"expected a PrefixId, got {type(pid).__name__}")
        entry = self.index.get(pid.user_id)
        if entry is not None and entry.pid == pid and entry.state is not EntryState.PENDING:
            found = Lookup.HIT
        else:
            found = Lookup.STALE_MISS if entry is not None and entry.pid != pid else Lookup.MISS
        if counted:
            self.count_lookup(found)
        return entry if found is Lookup.HIT else None

    def count_lookup(self, found: Lookup) -> None:
        """Count one lookup that found ``found``."""
        if found is Lookup.HIT:
            self.counters.hits += 1
        elif found is Lookup.STALE_MISS:
            self.counters.stale_misses += 1
        else:
            self.counters.misses += 1

    def in_use_entry(self, pid: PrefixId) -> Entry:
        entry = self.index.get(pid.user_id)
        if entry is None or entry.pid != pid or entry.pins == 0:
            raise CacheStateError(f"{pid} is not in use (acquire it first)")
        return entry

    # ---- reporting -------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of reserved pages (O(1))."""
        return self.index.used_pages * self.arena.page_bytes

    @property
    def unevictable_bytes(self) -> int:
        """Bytes admission cannot reclaim: PENDING, READY and in-use entries (O(1))."""
        return (self.index.used_pages - self.index.evictable_pages) * self.arena.page_bytes

    def stats(self) -> TierStats:
        entries = self.index.entries()
        page_bytes = self.arena.page_bytes
        by_state = {s: sum(e.state is s for e in entries) for s in EntryState}
        used, unevictable = self.used_bytes, self.unevictable_bytes
        c = self.counters
        return TierStats(
            budget_bytes=self.arena.budget_bytes, arena_bytes=self.arena.arena_bytes,
            page_bytes=page_bytes, num_pages=self.arena.num_pages, used_bytes=used,
            unevictable_bytes=unevictable, free_pages=self.allocator.free_pages,
            largest_free_run_pages=self.allocator.largest_free_run,
            pending=by_state[EntryState.PENDING], ready=by_state[EntryState.READY],
            idle=by_state[EntryState.IDLE], in_use=sum(e.pins > 0 for e in entries),
            admitted=c.admitted, evictions=c.evictions, replaced=c.replaced, aborted=c.aborted,
            expired=c.expired, hits=c.hits, misses=c.misses, stale_misses=c.stale_misses,
            refusals=dict(c.refusals))

    def check_integrity(self) -> None:
        """Every byte and page accounted for; index, LRU and allocator consistent."""
        arena = self.arena
        require(arena.allocated_bytes() == arena.arena_bytes,
                f"arena tensors hold {arena.allocated_bytes()} bytes, expected "
                f"{arena.arena_bytes}")
        require(arena.arena_bytes <= arena.budget_bytes,
                f"arena {arena.arena_bytes} bytes exceeds budget {arena.budget_bytes}")
        self.index.check_integrity()
        used_pages = sum(e.run.length for e in self.index.entries())
        require(used_pages + self.allocator.free_pages == arena.num_pages,
                "used + free pages != arena pages")
