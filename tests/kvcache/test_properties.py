"""Property tests: random operation sequences against both tiers, integrity after every step.

What must hold whatever the sequence: never over budget; every byte and page accounted for;
a refused admission changes nothing; PENDING, leased and in-use entries are never evicted; what
``acquire``/``lookup`` return is exactly the data stored for that ``PrefixId`` (no entry is
ever overwritten by another); expired host entries are never returned.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from relaygr.errors import CacheStateError
from relaygr.kvcache import EntryState, PrefixId, Refusal
from relaygr.kvcache.index import Entry
from relaygr.kvcache.pools import slice_tokens
from relaygr.kvcache.store import PendingEntry
from tests.kvcache.helpers import (
    FakeClock,
    assert_kv_equal,
    head,
    make_host,
    make_kv,
    make_pool,
    snapshot,
)

PAGES = 10
users = st.integers(0, 5)
tokens = st.integers(1, 26)         # up to 7 pages of 4 tokens: sometimes too large for 10 pages
versions = st.integers(0, 2)


def deadline(entry: Entry) -> float:
    """A READY entry's lease deadline (``mark_ready`` always sets one)."""
    assert entry.lease_deadline_s is not None
    return entry.lease_deadline_s


class DevicePoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.pool = make_pool(PAGES, self.clock, lease_s=2.0, slack_bytes=100)
        self.pending: dict[int, PendingEntry] = {}
        self.held: Counter[PrefixId] = Counter()

    def entries(self) -> list[Entry]:
        return self.pool.store.index.entries()

    def protected(self, except_user: int) -> dict[PrefixId, Entry]:
        now = self.clock()
        return {e.pid: e for e in self.entries() if e.pid.user_id != except_user and (
            e.state is EntryState.PENDING or e.pins > 0
            or (e.state is EntryState.READY and deadline(e) > now))}

    @rule(user=users, num_tokens=tokens, version=versions, timed=st.booleans())
    def begin(self, user: int, num_tokens: int, version: int, timed: bool) -> None:
        pid = PrefixId(user, num_tokens, version)
        self.pool.expire_leases()             # so that begin's own expiry changes nothing
        before = snapshot(self.pool.store)
        current = self.pool.store.index.get(user)
        if current is not None and current.pid == pid:
            with pytest.raises(CacheStateError):
                self.pool.begin(pid, timed=timed)
            assert snapshot(self.pool.store) == before
            return
        protected = {p: (e.run, e.state) for p, e in self.protected(user).items()}
        had_room = self.pool.store.allocator.largest_free_run >= -(-num_tokens // 4)
        evictions = self.pool.stats.evictions
        pending = self.pool.begin(pid, timed=timed)
        if pending is None:
            assert snapshot(self.pool.store) == before
            reason = self.pool.last_refusal
            if reason is Refusal.USER_BUSY:
                assert current is not None and (current.state is EntryState.PENDING
                                                or current.pins > 0)
            else:
                assert not had_room or reason is Refusal.TOO_LARGE
            return
        for p, (run, state) in protected.items():
            entry = self.pool.store.index.get(p.user_id)
            assert entry is not None and (entry.pid, entry.run, entry.state) == (p, run, state)
        if had_room:
            assert self.pool.stats.evictions == evictions   # no eviction when a run was free
        self.pending[user] = pending

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), split=st.booleans(), lease=st.booleans())
    def write_and_commit(self, data: st.DataObject, split: bool, lease: bool) -> None:
        user = data.draw(st.sampled_from(sorted(self.pending)))
        pending = self.pending.pop(user)
        kv = make_kv(pending.pid, pending.timed)
        cut = pending.pid.num_tokens // 2
        if split and cut:
            self.pool.write(pending, head(kv, cut))
            self.pool.write(pending, slice_tokens(kv, cut), start_token=cut)
        else:
            self.pool.write(pending, kv)
        self.pool.commit(pending, kv.last_hidden, lease=lease)
        info = self.pool.lookup(user)
        assert info is not None
        if lease:
            assert info.state is EntryState.READY and info.lease_deadline_s == self.clock() + 2.0
        else:
            assert info.state is EntryState.IDLE and info.lease_deadline_s is None

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        user = data.draw(st.sampled_from(sorted(self.pending)))
        self.pool.abort(self.pending.pop(user))
        assert self.pool.lookup(user) is None

    @rule(user=users, stale=st.booleans())
    def acquire(self, user: int, stale: bool) -> None:
        entry = self.pool.store.index.get(user)
        if entry is None:
            assert self.pool.acquire(PrefixId(user, 1, 0)) is None
            return
        pid = PrefixId(user, entry.pid.num_tokens, entry.pid.version + 10) if stale else entry.pid
        view = self.pool.acquire(pid)
        if stale or entry.state is EntryState.PENDING:
            assert view is None
            return
        assert view is not None
        assert_kv_equal(view, make_kv(pid, entry.timed))
        self.held[pid] += 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.held, key=repr)))
        self.pool.release(pid)
        self.held[pid] -= 1
        if not self.held[pid]:
            del self.held[pid]

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.5]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def expire_leases(self) -> None:
        ready_due = sum(1 for e in self.entries() if e.state is EntryState.READY and not e.pins
                        and deadline(e) <= self.clock())
        assert self.pool.expire_leases() == ready_due
        assert not any(e.state is EntryState.READY and not e.pins
                       and deadline(e) <= self.clock()
                       for e in self.entries())

    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity()
        stats = self.pool.stats
        assert stats.arena_bytes <= stats.budget_bytes and stats.used_bytes <= stats.arena_bytes
        for pid, count in self.held.items():
            entry = self.pool.store.index.get(pid.user_id)
            assert entry is not None and entry.pid == pid and entry.pins == count
        for entry in self.entries():
            if entry.state is not EntryState.PENDING:
                assert_kv_equal(self.pool.store.view(entry), make_kv(entry.pid, entry.timed))


class HostTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.host = make_host(PAGES, self.clock, ttl_s=10.0)
        self.stored_at: dict[PrefixId, float] = {}
        self.held: Counter[PrefixId] = Counter()

    @rule(user=users, num_tokens=tokens, version=versions, timed=st.booleans())
    def put(self, user: int, num_tokens: int, version: int, timed: bool) -> None:
        pid = PrefixId(user, num_tokens, version)
        self.host.expire()
        before = snapshot(self.host.store)
        pinned = {e.pid: e.run for e in self.host.store.index.entries() if e.pins}
        if self.host.put(pid, make_kv(pid, timed)):
            self.stored_at[pid] = self.clock()
            hit = self.host.lookup(user)
            assert hit is not None and hit.pid == pid
        else:
            assert snapshot(self.host.store) == before
        for p, run in pinned.items():
            entry = self.host.store.index.get(p.user_id)
            assert entry is not None and entry.pid == p and entry.run == run

    @rule(user=users)
    def lookup(self, user: int) -> None:
        hit = self.host.lookup(user)
        if hit is not None:
            assert self.clock() - self.stored_at[hit.pid] < 10.0
            entry = self.host.store.index.get(user)
            assert entry is not None
            assert_kv_equal(hit.kv, make_kv(hit.pid, entry.timed))

    @rule(user=users)
    def acquire(self, user: int) -> None:
        entry = self.host.store.index.get(user)
        if entry is None:
            return
        view = self.host.acquire(entry.pid)
        if view is None:
            assert self.clock() - self.stored_at[entry.pid] >= 10.0
            return
        assert self.clock() - self.stored_at[entry.pid] < 10.0
        assert_kv_equal(view, make_kv(entry.pid, entry.timed))
        self.held[entry.pid] += 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.held, key=repr)))
        self.host.release(pid)
        self.held[pid] -= 1
        if not self.held[pid]:
            del self.held[pid]

    @rule(seconds=st.sampled_from([1.0, 4.0, 9.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def expire(self) -> None:
        self.host.expire()
        now = self.clock()
        for entry in self.host.store.index.entries():
            assert entry.pins or now - self.stored_at[entry.pid] < 10.0

    @invariant()
    def integrity(self) -> None:
        self.host.check_integrity()
        stats = self.host.stats
        assert stats.arena_bytes <= stats.budget_bytes and stats.used_bytes <= stats.arena_bytes
        for pid, count in self.held.items():
            entry = self.host.store.index.get(pid.user_id)
            assert entry is not None and entry.pid == pid and entry.pins == count


_settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestDevicePool = DevicePoolMachine.TestCase
TestDevicePool.settings = _settings
TestHostTier = HostTierMachine.TestCase
TestHostTier.settings = _settings
