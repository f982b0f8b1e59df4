"""Layer 2 of the cache: entries, their states, pins, leases, the LRU, and where each one lives.

One tier (device pool or host expander) has one ``CacheIndex``: at most one entry per user, keyed
by ``PrefixId`` (user, token count, version) so a changed prefix never matches a stale entry.

States and transitions::

    admit -> PENDING --mark_ready(deadline)--> READY --last unpin / lease expiry--> IDLE
    IDLE --lease(deadline)--> READY (a pre-infer signal found it complete: its ranking comes)
    READY --lease(deadline)--> READY (again: a later deadline, and a lease no pin held so far)
    PENDING --mark_idle (a tier without leases)--> IDLE
    PENDING --remove (abort)--> gone;   IDLE, not pinned --admit of another entry--> evicted

- PENDING: pages reserved, being written; never evicted, never pinned.
- READY: complete and leased until ``lease_deadline_s``; never evicted. Pinned while in use.
  A pin consumes the leases granted before it: the last unpin turns the entry IDLE only when
  no lease was granted after the pins it ends were taken (one that was is another ranking
  leg's, which has yet to come: it stays READY until consumed or over).
- IDLE: complete, not leased; evictable exactly when not pinned (``pins == 0``).
The LRU holds exactly the evictable entries, least recently used first (an entry enters at the
back when it becomes evictable: last unpin, lease expiry, host commit).

Admission (``admit``) never evicts a PENDING, READY or pinned entry. It frees the user's older
entry (unless that one is PENDING or in use; a newer version supersedes even a leased one), then
IDLE entries in LRU order, but only those overlapping the run it finally takes (see
``RunAllocator.plan``). If no contiguous run can be formed that way, it refuses with a reason
and changes nothing.

This layer owns no tensors; it imports the allocator only.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from relaygr.errors import CacheStateError, InvalidInputError
from relaygr.kvcache.allocator import PageRun, RunAllocator
from relaygr.kvcache.integrity import require


@dataclass(frozen=True)
class PrefixId:
    """What a cached prefix covers: the first ``num_tokens`` events of the window of user
    ``user_id``'s history that the model reads (the whole history while it fits the model).

    ``version`` is a hash of those events and of where the window starts, computed by the
    history store: a prefix whose events or window changed has another version, so a stale
    entry can never match an exact lookup.
    """

    user_id: int
    num_tokens: int
    version: int

    def __post_init__(self) -> None:
        for name in ("user_id", "num_tokens", "version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidInputError(f"PrefixId.{name} must be an int, got {value!r}")
        if self.num_tokens <= 0:
            raise InvalidInputError(f"PrefixId.num_tokens must be positive, got {self.num_tokens}")


class EntryState(Enum):
    PENDING = "pending"   # being computed or loaded; its pages are reserved
    READY = "ready"       # complete and leased to the ranking request that will consume it
    IDLE = "idle"         # complete, not leased: evictable unless pinned (in use)


class Refusal(Enum):
    """Why an admission failed (nothing was changed)."""

    TOO_LARGE = "too_large"     # more pages than the whole arena
    NO_SPACE = "no_space"       # free + evictable pages are fewer than needed
    FRAGMENTED = "fragmented"   # enough pages, but no contiguous run can be formed
    USER_BUSY = "user_busy"     # the user's current entry is PENDING or in use


@dataclass(eq=False)
class Entry:
    """Internal, mutable record of one cached prefix (layers above hand out ``EntryInfo``)."""

    pid: PrefixId
    run: PageRun
    timed: bool
    serial: int                       # unique per admission: pending handles are checked by it
    created_s: float
    state: EntryState = EntryState.PENDING
    pins: int = 0                     # ranking requests (or copies) currently reading it
    lease_deadline_s: float | None = None
    written_tokens: int = 0           # tokens 0..written_tokens-1 hold data (PENDING only)
    # the continuation time of the written tokens (``PrefixKV.next_timestamp``, under
    # time_query="next"; the latest write's, which ends them), else None
    next_ts: int | None = None
    leases: int = 0                   # leases granted (mark_ready, lease)
    leases_pinned: int = 0            # of those, granted before a pin taken since: consumed

    @property
    def evictable(self) -> bool:
        return self.state is EntryState.IDLE and self.pins == 0


@dataclass(frozen=True)
class EntryInfo:
    """A read-only snapshot of an entry, for callers above the cache."""

    pid: PrefixId
    state: EntryState
    pins: int
    timed: bool
    pages: PageRun
    lease_deadline_s: float | None

    @property
    def in_use(self) -> bool:
        return self.pins > 0

    @staticmethod
    def of(entry: Entry) -> EntryInfo:
        return EntryInfo(entry.pid, entry.state, entry.pins, entry.timed, entry.run,
                         entry.lease_deadline_s)


@dataclass(frozen=True)
class Admitted:
    entry: Entry
    victims: tuple[Entry, ...]        # IDLE entries evicted to make room, in LRU order
    replaced: Entry | None            # the user's older entry, dropped


@dataclass(frozen=True)
class Refused:
    reason: Refusal


class CacheIndex:
    """Entries of one tier over one allocator (see the module docstring for the rules)."""

    def __init__(self, allocator: RunAllocator, page_tokens: int) -> None:
        self.allocator = allocator
        self.page_tokens = page_tokens
        self._by_user: dict[int, Entry] = {}
        self._lru: OrderedDict[int, Entry] = OrderedDict()   # user -> evictable entry
        self._ready: dict[int, Entry] = {}                   # user -> READY entry
        self._serials = itertools.count(1)
        # Running totals (O(1) occupancy for per-request admission decisions).
        self.used_pages = 0
        self.evictable_pages = 0

    # ---- queries ---------------------------------------------------------------------------

    def get(self, user_id: int) -> Entry | None:
        return self._by_user.get(user_id)

    def entries(self) -> list[Entry]:
        """All entries in admission order (oldest first)."""
        return list(self._by_user.values())

    def lru(self) -> list[Entry]:
        """Evictable entries, least recently used first."""
        return list(self._lru.values())

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    # ---- admission -------------------------------------------------------------------------

    def admit(self, pid: PrefixId, timed: bool, now_s: float) -> Admitted | Refused:
        """Reserve pages for ``pid`` as a new PENDING entry (see the module docstring)."""
        old = self._by_user.get(pid.user_id)
        if old is not None:
            if old.pid == pid:
                raise CacheStateError(f"{pid} is already cached ({old.state.value})")
            if old.state is EntryState.PENDING or old.pins:
                return Refused(Refusal.USER_BUSY)
        pages = self.pages_for(pid.num_tokens)
        if pages > self.allocator.num_pages:
            return Refused(Refusal.TOO_LARGE)
        freed = [] if old is None else [old.run]
        considered: list[Entry] = []

        def candidates() -> Iterator[PageRun]:
            for entry in self._lru.values():
                if entry is not old:
                    considered.append(entry)
                    yield entry.run

        placement = self.allocator.plan(pages, freed, candidates())
        if placement is None:
            reclaimable = self.allocator.free_pages + sum(r.length for r in freed)
            reclaimable += sum(e.run.length for e in considered)
            return Refused(Refusal.FRAGMENTED if reclaimable >= pages else Refusal.NO_SPACE)
        used = considered[:placement.candidates_used]
        victims = tuple(e for e in used if e.run.overlaps(placement.run))
        for entry in ((old,) if old is not None else ()) + victims:
            self.remove(entry)
        run = self.allocator.allocate(pages)
        assert run == placement.run, f"allocator chose {run}, plan said {placement.run}"
        entry = Entry(pid, run, timed, next(self._serials), now_s)
        self._by_user[pid.user_id] = entry
        self.used_pages += run.length
        return Admitted(entry, victims, old)

    # ---- transitions -----------------------------------------------------------------------

    def mark_ready(self, entry: Entry, lease_deadline_s: float) -> None:
        """PENDING -> READY, leased until ``lease_deadline_s``."""
        self._complete(entry)
        entry.state = EntryState.READY
        entry.lease_deadline_s = lease_deadline_s
        entry.leases += 1
        self._ready[entry.pid.user_id] = entry

    def mark_idle(self, entry: Entry) -> None:
        """PENDING -> IDLE (a tier without leases), or READY -> IDLE (lease over)."""
        if entry.state is EntryState.PENDING:
            self._complete(entry)
        else:
            assert entry.state is EntryState.READY, f"mark_idle on {entry.state}"
            del self._ready[entry.pid.user_id]
        entry.state = EntryState.IDLE
        entry.lease_deadline_s = None
        if entry.pins == 0:
            self._lru_add(entry)

    def lease(self, entry: Entry, lease_deadline_s: float) -> None:
        """A complete entry leased (again) until ``lease_deadline_s``, or later if its lease ran
        longer: IDLE -> READY (out of the LRU: not evictable until consumed or expired)."""
        assert entry.state is not EntryState.PENDING, "a PENDING entry is leased at mark_ready"
        if entry.state is EntryState.IDLE:
            self._lru_drop(entry)
            entry.state = EntryState.READY
            self._ready[entry.pid.user_id] = entry
        entry.lease_deadline_s = max(entry.lease_deadline_s or lease_deadline_s,
                                     lease_deadline_s)
        entry.leases += 1

    def pin(self, entry: Entry) -> None:
        """Mark ``entry`` in use: not evictable until every pin is released. The pin consumes
        the leases granted so far (its release ends them)."""
        assert entry.state is not EntryState.PENDING, "a PENDING entry cannot be pinned"
        self._lru_drop(entry)
        entry.pins += 1
        entry.leases_pinned = entry.leases

    def unpin(self, entry: Entry) -> None:
        """Release one pin; the last one consumes the leases the pins held (READY -> IDLE) and
        the entry becomes the most recently used. A lease granted while it was pinned (a later
        pre-infer signal: its ranking leg has yet to come) keeps it READY until that leg
        consumes it or the lease is over (``expire_leases``)."""
        assert entry.pins > 0, "unpin without pin"
        entry.pins -= 1
        if entry.pins:
            return
        if entry.state is EntryState.READY:
            if entry.leases_pinned == entry.leases:
                self.mark_idle(entry)
        else:
            self._lru_add(entry)

    def touch(self, entry: Entry) -> None:
        """Make an evictable entry the most recently used (no-op for others)."""
        if entry.evictable:
            self._lru.move_to_end(entry.pid.user_id)

    def expire_leases(self, now_s: float) -> list[Entry]:
        """READY entries not in use whose lease ended -> IDLE, in deadline order."""
        due = [e for e in self._ready.values()
               if e.pins == 0 and e.lease_deadline_s is not None and e.lease_deadline_s <= now_s]
        due.sort(key=lambda e: (e.lease_deadline_s, e.serial))
        for entry in due:
            self.mark_idle(entry)
        return due

    def remove(self, entry: Entry) -> None:
        """Forget ``entry`` (evicted, replaced, aborted or expired) and free its pages."""
        assert entry.pins == 0, "removing an entry in use"
        user = entry.pid.user_id
        assert self._by_user.get(user) is entry, f"removing unknown entry {entry.pid}"
        self._lru_drop(entry)
        del self._by_user[user]
        self._ready.pop(user, None)
        self.allocator.free(entry.run)
        self.used_pages -= entry.run.length

    def _lru_add(self, entry: Entry) -> None:
        assert entry.evictable, "only evictable entries enter the LRU"
        self._lru[entry.pid.user_id] = entry
        self.evictable_pages += entry.run.length

    def _lru_drop(self, entry: Entry) -> None:
        if self._lru.pop(entry.pid.user_id, None) is not None:
            self.evictable_pages -= entry.run.length

    def _complete(self, entry: Entry) -> None:
        assert entry.state is EntryState.PENDING, f"completing a {entry.state.value} entry"
        assert entry.written_tokens == entry.pid.num_tokens, "completing a partly written entry"

    # ---- integrity -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        entries = list(self._by_user.values())
        for user, entry in self._by_user.items():
            require(entry.pid.user_id == user, f"entry {entry.pid} filed under user {user}")
            require(entry.pins >= 0, f"{entry.pid} has {entry.pins} pins")
            require(entry.run.length == self.pages_for(entry.pid.num_tokens),
                    f"{entry.pid} holds {entry.run.length} pages")
            if entry.state is EntryState.PENDING:
                require(entry.pins == 0, f"PENDING {entry.pid} is pinned")
                require(0 <= entry.written_tokens <= entry.pid.num_tokens,
                        f"{entry.pid} wrote {entry.written_tokens} tokens")
            else:
                require(entry.written_tokens == entry.pid.num_tokens,
                        f"{entry.pid} is {entry.state.value} but partly written")
            require(0 <= entry.leases_pinned <= entry.leases,
                    f"{entry.pid} pinned {entry.leases_pinned} of {entry.leases} leases")
            require((entry.lease_deadline_s is not None) == (entry.state is EntryState.READY),
                    f"{entry.pid} lease {entry.lease_deadline_s} in state {entry.state.value}")
        lru = {id(e) for e in self._lru.values()}
        require(lru == {id(e) for e in entries if e.evictable}, "LRU != evictable entries")
        require(all(self._by_user.get(u) is e for u, e in self._lru.items()), "LRU key mismatch")
        ready = {id(e) for e in self._ready.values()}
        require(ready == {id(e) for e in entries if e.state is EntryState.READY},
                "READY set out of sync")
        require(all(self._by_user.get(u) is e for u, e in self._ready.items()),
                "READY key mismatch")
        require(self.used_pages == sum(e.run.length for e in entries), "used_pages drifted")
        require(self.evictable_pages == sum(e.run.length for e in self._lru.values()),
                "evictable_pages drifted")
        serials = [e.serial for e in entries]
        require(len(set(serials)) == len(serials), "duplicate serials")
        self.allocator.check_integrity(e.run for e in entries)
