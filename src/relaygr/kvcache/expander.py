"""Layer 3 (tiering): moving prefixes between the device pool and the host tier, deduplicated.

``Expander.release(pid)`` ends a ranking request's use of a device entry and demotes it: the
entry is copied to the host tier (skipped if the host already holds that ``pid``) and then
released on the device, where it stays IDLE until evicted (the tiers are inclusive). With
``extended=ExtendedPrefix(longer_pid, suffix_kv)`` the host gets the entry followed by the
suffix K/V the ranking pass kept (``RankOutput.computed``): the prefix of the user's next visit.

``Expander.reload(target, base, extend)`` brings a host entry back for a new request::

    device already holds target (READY/IDLE) -> ON_DEVICE   nothing copied
    device holds target PENDING              -> PENDING     await pool.wait_settled(target)
    a load of this user is in flight         -> joins it (same target) or BUSY (another target)
    host holds base (unexpired)              -> begin(target) on the device, copy base's K/V
                                                (side stream on CUDA), extend, commit -> LOADED
    otherwise                                -> HOST_MISS / REFUSED (device admission failed)

The device entry is PENDING from the first moment, so ranking requests that look it up meanwhile
wait on the pool like for a pre-infer. ``Expander.start`` makes the same decision at once and
returns the load as a future (already done when no copy starts). Pinning ``base`` on the host
for the copy counts no lookup in the host's ``TierStats``: the engine counts each ranking
request's, once it knows what served it. Extension: when ``target`` has more tokens than ``base``,
``extend(past)`` gets the reloaded prefix as a device ``PrefixKV`` (zero-copy) and returns the
K/V of the new tokens (or of the whole target prefix, as ``HSTU.prefill(new, past=past)``
does); the expander writes them after the reloaded ones. The caller has checked that ``base``
is a prefix of ``target`` (same events: the history store hashes the first ``base.num_tokens``
events to ``base.version``). A failed load aborts the device entry and raises to every caller
sharing it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from enum import Enum

from relaygr.errors import ConfigError, InvalidInputError
from relaygr.kvcache.device import DeviceKVPool
from relaygr.kvcache.host import HostKVTier
from relaygr.kvcache.index import EntryState, PrefixId
from relaygr.kvcache.pools import slice_tokens
from relaygr.kvcache.store import PendingEntry
from relaygr.kvcache.transfer import Transfer
from relaygr.model import PrefixKV

Extend = Callable[[PrefixKV], Awaitable[PrefixKV]]


class ReloadOutcome(Enum):
    ON_DEVICE = "on_device"     # the device already holds the target, complete
    PENDING = "pending"         # the target is being computed on the device: wait on the pool
    LOADED = "loaded"           # reloaded (by this call or one it joined): READY and leased
    HOST_MISS = "host_miss"     # the host holds no unexpired entry equal to ``base``
    REFUSED = "refused"         # the device pool could not admit the target
    BUSY = "busy"               # a load of another target of this user is in flight


@dataclass
class ExpanderStats:
    """Counters; ``reload_copies``/``demotion_copies`` count actual host<->device copies."""

    reload_copies: int = 0
    reload_bytes: int = 0
    shared: int = 0             # calls that joined a load already in flight
    on_device: int = 0
    pending: int = 0
    host_misses: int = 0
    refused: int = 0
    busy: int = 0
    failed: int = 0
    demotion_copies: int = 0
    demotion_bytes: int = 0
    demotion_skips: int = 0     # the host already held (or was storing) the same pid
    demotion_refusals: int = 0

    def snapshot(self) -> ExpanderStats:
        return ExpanderStats(**{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass(frozen=True)
class ExtendedPrefix:
    """A longer prefix to demote instead of the device entry: its id, and the K/V of the tokens
    after the entry's (any device)."""

    pid: PrefixId
    tail: PrefixKV


@dataclass(eq=False)
class _Load:
    """One reload in flight: the device entry being filled and the host entry it comes from."""

    pending: PendingEntry
    base: PrefixId
    source: PrefixKV                  # view of the pinned host entry
    extend: Extend | None
    started: bool = False
    task: asyncio.Future[ReloadOutcome] | None = None

    @property
    def target(self) -> PrefixId:
        return self.pending.pid


class Expander:
    """Reloads and demotions between one device pool and one host tier (module docstring)."""

    def __init__(self, pool: DeviceKVPool, host: HostKVTier) -> None:
        if pool.layout != host.layout:
            raise ConfigError(f"device layout {pool.layout} != host layout {host.layout}")
        self.pool = pool
        self.host = host
        self.transfer = Transfer(pool.device)
        self._stats = ExpanderStats()
        self._inflight: dict[int, _Load] = {}

    @property
    def stats(self) -> ExpanderStats:
        return self._stats.snapshot()

    def close(self) -> None:
        """Release the copy thread (CPU); call when the instance stops."""
        self.transfer.close()

    def loading(self, user_id: int) -> PrefixId | None:
        """The target being reloaded for ``user_id`` right now, if any."""
        load = self._inflight.get(user_id)
        return None if load is None else load.target

    # ---- reload ----------------------------------------------------------------------------

    async def reload(self, target: PrefixId, base: PrefixId,
                     extend: Extend | None = None) -> ReloadOutcome:
        """Make ``target`` READY on the device from the host's ``base`` (module docstring)."""
        return await self.start(target, base, extend)

    def start(self, target: PrefixId, base: PrefixId,
              extend: Extend | None = None) -> asyncio.Future[ReloadOutcome]:
        """``reload``'s decision, made at once (on the event loop): a future already done
        when no copy starts (ON_DEVICE, PENDING, HOST_MISS, REFUSED, BUSY), else the load in
        flight, begun by this call or, for the same target, joined. For a caller that must
        say now whether a reload started (a pre-infer signal answers at once)."""
        _check_reload_args(target, base, extend)
        user = target.user_id
        load = self._inflight.get(user)
        if load is not None:
            if load.target != target:
                self._stats.busy += 1
                return _settled(ReloadOutcome.BUSY)
            self._stats.shared += 1
            assert load.task is not None, "an in-flight load has a task"
            return asyncio.shield(load.task)
        info = self.pool.lookup(user)
        if info is not None and info.pid == target:
            if info.state is EntryState.PENDING:
                self._stats.pending += 1
                return _settled(ReloadOutcome.PENDING)
            self._stats.on_device += 1
            return _settled(ReloadOutcome.ON_DEVICE)
        source = self.host.acquire(base, counted=False)   # a pin for the copy, no lookup
        if source is None:
            self._stats.host_misses += 1
            return _settled(ReloadOutcome.HOST_MISS)
        pending = self.pool.begin(target, timed=source.has_timestamps)
        if pending is None:
            self.host.release(base)
            self._stats.refused += 1
            return _settled(ReloadOutcome.REFUSED)
        load = _Load(pending, base, source, extend)
        task = load.task = asyncio.ensure_future(self._load(load))
        task.add_done_callback(lambda _: self._finished(load))
        self._inflight[user] = load
        return asyncio.shield(task)

    async def _load(self, load: _Load) -> ReloadOutcome:
        load.started = True
        pending, base, target = load.pending, load.base, load.target
        host_pinned = True
        try:
            await self.transfer.copy(
                lambda nb: self.pool.write(pending, load.source, 0, non_blocking=nb))
            self._stats.reload_copies += 1
            self._stats.reload_bytes += load.source.nbytes
            self.host.release(base)
            host_pinned = False
            if load.extend is not None and target.num_tokens > base.num_tokens:
                past = self.pool.written_view(pending, base.num_tokens)
                new = _new_tokens(await load.extend(past), base, target)
                if self.transfer.asynchronous:
                    # on the side stream, awaited: a copy queued on the loop thread's stream
                    # would not be ordered before a ranking pass on the compute stream that
                    # reads the committed entry
                    await self.transfer.copy(lambda nb: self.pool.write(
                        pending, new, base.num_tokens, non_blocking=nb))
                else:
                    self.pool.write(pending, new, base.num_tokens)   # a few tokens: inline
            self.pool.commit(pending)
        except BaseException:
            self._stats.failed += 1
            if host_pinned:
                self.host.release(base)
            self.pool.abort(pending)
            raise
        finally:
            self._forget(load)
        return ReloadOutcome.LOADED

    def _forget(self, load: _Load) -> None:
        if self._inflight.get(load.target.user_id) is load:
            del self._inflight[load.target.user_id]

    def _finished(self, load: _Load) -> None:
        """Done-callback: also covers a load cancelled before it ever ran."""
        self._forget(load)
        if not load.started:
            self._stats.failed += 1
            self.host.release(load.base)
            self.pool.abort(load.pending)

    # ---- demotion --------------------------------------------------------------------------

    async def release(self, pid: PrefixId, *, extended: ExtendedPrefix | None = None) -> bool:
        """Demote the device entry ``pid`` (held by the caller) to the host, then release it on
        the device. Returns whether the host now holds what was demoted.

        With ``extended``, the host stores ``pid``'s tokens followed by ``extended.tail`` (the
        suffix the ranking pass computed, ``RankOutput.computed``) as ``extended.pid``: the
        next visit's longer prefix, written straight into the host arena (no concatenation).
        Arguments are checked before the host changes; the device release happens whatever
        the check's or the demotion's outcome (a bad ``extended`` must not pin ``pid`` for
        good)."""
        kv = self.pool.view_in_use(pid)
        try:
            parts = [kv] if extended is None else \
                [kv, _check_extended(self.host, pid, kv, extended)]
            stored = pid if extended is None else extended.pid
            return await self._demote(stored, parts)
        finally:
            self.pool.release(pid)

    async def _demote(self, pid: PrefixId, parts: list[PrefixKV]) -> bool:
        held = self.host.info(pid.user_id)
        if held is not None and held.pid == pid:
            if held.state is not EntryState.PENDING:
                self.host.refresh(pid)
            self._stats.demotion_skips += 1
            return True
        pending = self.host.begin(pid, timed=parts[0].has_timestamps)
        if pending is None:
            self._stats.demotion_refusals += 1
            return False
        try:
            def write_parts(non_blocking: bool) -> None:
                start = 0
                for part in parts:
                    self.host.write(pending, part, start, non_blocking=non_blocking)
                    start += part.num_tokens

            await self.transfer.copy(write_parts)   # holds ``parts``: none freed under the copy
        except BaseException:
            self.host.abort(pending)
            raise
        self.host.commit(pending)
        self._stats.demotion_copies += 1
        self._stats.demotion_bytes += sum(p.nbytes for p in parts)
        return True


def _check_extended(host: HostKVTier, pid: PrefixId, kv: PrefixKV,
                    extended: ExtendedPrefix) -> PrefixKV:
    if not isinstance(extended, ExtendedPrefix):
        raise InvalidInputError(f"expected an ExtendedPrefix, got {type(extended).__name__}")
    tail, longer = extended.tail, extended.pid
    host.layout.check(tail)
    if longer.user_id != pid.user_id or longer.num_tokens != pid.num_tokens + tail.num_tokens:
        raise InvalidInputError(
            f"{longer} is not {pid} extended by {tail.num_tokens} tokens of the same user")
    if tail.has_timestamps != kv.has_timestamps:
        raise InvalidInputError("the tail's timestamps do not match the cached prefix's")
    if kv.next_timestamp is not None and (tail.timestamps is None or tail.next_timestamp is None
                                          or int(tail.timestamps[0]) != kv.next_timestamp):
        raise InvalidInputError(f"the cached prefix continues at {kv.next_timestamp}; the tail "
                                "does not start then (time_query='next')")
    if kv.next_timestamp is None and tail.next_timestamp is not None:
        raise InvalidInputError("a tail with a continuation time cannot extend a prefix without")
    return tail


def _settled(outcome: ReloadOutcome) -> asyncio.Future[ReloadOutcome]:
    """A future already done with ``outcome`` (``Expander.start`` when no copy starts)."""
    future: asyncio.Future[ReloadOutcome] = asyncio.get_running_loop().create_future()
    future.set_result(outcome)
    return future


def _check_reload_args(target: PrefixId, base: PrefixId, extend: Extend | None) -> None:
    if not isinstance(target, PrefixId) or not isinstance(base, PrefixId):
        raise InvalidInputError("reload takes PrefixIds for target and base")
    if target.user_id != base.user_id:
        raise InvalidInputError(f"base {base} belongs to another user than target {target}")
    if base.num_tokens > target.num_tokens:
        raise InvalidInputError(f"base {base} is longer than target {target}")
    if base.num_tokens < target.num_tokens and extend is None:
        raise InvalidInputError(f"target {target} is longer than base {base}: give extend")
    if base.num_tokens == target.num_tokens and base != target:
        raise InvalidInputError(f"base {base} and target {target} cover the same tokens "
                                "but differ in version")


def _new_tokens(kv: PrefixKV, base: PrefixId, target: PrefixId) -> PrefixKV:
    """The K/V of tokens ``base.num_tokens..`` from what ``extend`` returned."""
    if not isinstance(kv, PrefixKV):
        raise InvalidInputError(f"extend must return a PrefixKV, got {type(kv).__name__}")
    if kv.num_tokens == target.num_tokens:
        return slice_tokens(kv, base.num_tokens)
    if kv.num_tokens == target.num_tokens - base.num_tokens:
        return kv
    raise InvalidInputError(
        f"extend returned {kv.num_tokens} tokens; expected {target.num_tokens - base.num_tokens} "
        f"new ones (or all {target.num_tokens})")
