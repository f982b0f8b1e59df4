"""Where a user's prefix K/V lives on one instance, and moving it there.

``Residency`` wraps the instance's device pool, its host tier and their expander, and speaks in
requests rather than cache operations:

* ``find(spec)``: for a ranking request, a pinned device view of exactly this prefix, waiting
  on a pre-infer in flight or reloading (and extending) a shorter host copy; None on a miss,
  and None when that reload or its extension fails (counted in ``reloads_failed``): the request
  then computes its prefix in full, a slower correct answer. It counts the request once in
  each tier's hits and misses, by the path it took.
* ``start_reload(spec, base)``: bring a host copy back (extended with the newer events), in the
  background; whether the copy started (a pre-infer's action says so).
* ``start_prefill(spec)``: reserve the entry and queue a chunked pre-infer job on the scheduler;
  a job that cannot even be built (an input the model refuses, no memory for its tensors)
  aborts the entry it reserved before the error goes up, so nothing waits on it.
* ``abandon(pid)``: the pre-infer's ranking leg will not come here (shed, failed over): a job
  not started yet is cancelled and its entry freed; one started finishes as an IDLE entry, and
  a complete one's lease ends, so neither counts against the footprint any more.
* ``finish(...)``: after ranking, release the entry and demote prefix + ranked suffix to host;
  after a full pass, keep what it computed (cache fill at ranking time).

Every cache operation runs on the event loop; tensor copies into a PENDING entry run on the
instance's workers (the cache's threading contract allows it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field

from relaygr.engine.executor import ComputeExecutor
from relaygr.engine.scheduler import InstanceScheduler, InstanceStoppedError, PrefillWork
from relaygr.engine.types import PrefixSpec, RankPath
from relaygr.kvcache import (
    DeviceKVPool,
    EntryState,
    Expander,
    ExtendedPrefix,
    HostKVTier,
    Lookup,
    PendingEntry,
    PrefixId,
    ReloadOutcome,
)
from relaygr.model import HSTU, PrefillInput, PrefixKV

log = logging.getLogger("relaygr.engine.residency")
# Failures of each kind (``Residency._failed``) logged with their traceback per instance; the
# rest are counted only (a fault that repeats would flood the log).
_LOGGED_FAILURES = 5
# What keeps a pre-infer's reload from starting, its prefix being neither on the device nor
# loading (``Residency.start_reload``).
_NOT_STARTED = (ReloadOutcome.BUSY, ReloadOutcome.REFUSED, ReloadOutcome.HOST_MISS)


@dataclass
class ResidencyCounters:
    prefills_started: int = 0
    prefills_failed: int = 0
    reloads_started: int = 0
    background_failed: int = 0
    admission_refused: int = 0
    fills: int = 0
    fill_refused: int = 0
    waits: int = 0
    reloads_failed: int = 0      # reloads (or their extensions) a ranking request met failing
    host_checks_failed: int = 0  # host copies left unused: checking their events raised
    # pre-infers whose ranking leg will not come (``abandon``): cancelled before their first
    # round (entry freed), or kept unleased (started or done: IDLE, evictable, once complete)
    preinfers_cancelled: int = 0
    preinfers_unleased: int = 0
    paths: dict[str, int] = field(default_factory=dict)


class Residency:
    """Device pool + optional host tier of one instance (see the module docstring)."""

    def __init__(self, model: HSTU, pool: DeviceKVPool, host: HostKVTier | None,
                 scheduler: InstanceScheduler, copier: ComputeExecutor,
                 reuse: bool = True) -> None:
        self.model = model
        self.pool = pool
        self.host = host if reuse else None
        self.reuse = reuse
        self.expander = Expander(pool, self.host) if self.host is not None else None
        self.scheduler = scheduler
        self.copier = copier
        self.counters = ResidencyCounters()
        self._inflight: dict[int, PrefillWork] = {}   # user -> pre-infer/extension job
        # user -> ranking requests waiting on a reload whose extension job is not queued yet
        # (the host copy still copying): the job counts them as its waiters once queued
        self._waiting: dict[int, int] = {}
        # user -> the entry its pre-infer job writes, until the job settles
        self._reserved: dict[int, PendingEntry] = {}
        # users whose pre-infer job was abandoned after it started: committed without a lease
        self._unleased: set[int] = set()
        # user -> the device entry reloaded from the host, until it is ranked from or the
        # user's entry is computed here instead (its ranking is then no host hit)
        self._from_host: dict[int, PrefixId] = {}
        self.background: set[asyncio.Future[object]] = set()

    def spawn(self, work: Coroutine[object, object, object]) -> None:
        """Run ``work`` in the background, keeping a reference until it ends. A failure (e.g.
        the instance stopped under a reload) is counted; whoever needs the result waits on
        the entry, which the pool or the expander has already aborted."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Future[object]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.counters.background_failed += 1

    # ---- lookups -----------------------------------------------------------------------------
    def resident(self, pid: PrefixId) -> EntryState | None:
        """State of exactly ``pid`` on the device, or of its reload in flight (PENDING)."""
        info = self.pool.lookup(pid.user_id)
        if info is not None and info.pid == pid:
            return info.state
        if self.expander is not None and self.expander.loading(pid.user_id) == pid:
            return EntryState.PENDING
        return None

    def host_base(self, spec: PrefixSpec) -> PrefixId | None:
        """A host copy that is a prefix of ``spec`` (same events), if the host holds one."""
        return self._host_copy(spec)[0]

    def _host_copy(self, spec: PrefixSpec) -> tuple[PrefixId | None, Lookup]:
        """``host_base``'s copy and what the host held for ``spec``: HIT (that copy),
        STALE_MISS (a copy of the user that is no prefix of ``spec``: other events, or
        longer), MISS (none, or one that could not be checked)."""
        if self.host is None:
            return None, Lookup.MISS
        hit = self.host.lookup(spec.pid.user_id)
        if hit is None:
            return None, Lookup.MISS
        if hit.pid.num_tokens > spec.num_tokens:
            return None, Lookup.STALE_MISS
        try:
            version = spec.version_at(hit.pid.num_tokens)     # the history store, maybe remote
        except (InstanceStoppedError, AssertionError):
            raise
        except Exception:      # unchecked, the copy is not used: the prefix is computed in full
            self._failed("host_checks_failed", "user %d's host copy could not be checked "
                         "against the request's events; not used", spec.pid.user_id)
            return None, Lookup.MISS
        if version != hit.pid.version:
            return None, Lookup.STALE_MISS
        return hit.pid, Lookup.HIT

    # ---- producing entries -------------------------------------------------------------------
    def start_prefill(self, spec: PrefixSpec) -> bool:
        """Reserve ``spec``'s entry and queue its pre-infer; False if the pool refused."""
        pending = self.pool.begin(spec.pid, timed=spec.timestamps is not None)
        if pending is None:
            self.counters.admission_refused += 1
            return False
        self._from_host.pop(spec.pid.user_id, None)      # this entry is computed here
        try:
            job = self.model.prefill_job([PrefillInput(spec.items, spec.timestamps)])
            track = job.tracks[0]
            work = self.scheduler.submit_prefill(
                job.step, lambda: job.done, lambda: self.pool.write(pending, track.tail()))
        except BaseException:
            # the reserved entry must not stay PENDING: a ranking request would wait on it
            self.counters.prefills_failed += 1
            self.pool.abort(pending)
            raise
        self._inflight[spec.pid.user_id] = work
        self._reserved[spec.pid.user_id] = pending
        self.counters.prefills_started += 1
        self.spawn(self._settle(spec.pid.user_id, work, pending))
        return True

    async def _settle(self, user: int, work: PrefillWork, pending: PendingEntry) -> None:
        try:
            await work.future
        except BaseException:
            if work.future.cancelled():       # abandoned: ``abandon`` freed the entry
                return
            self.counters.prefills_failed += 1
            self.pool.abort(pending)
            return
        finally:
            if self._inflight.get(user) is work:
                del self._inflight[user]
            if self._reserved.get(user) is pending:
                del self._reserved[user]
            leased = user not in self._unleased    # abandoned once started: no lease
            self._unleased.discard(user)
        try:
            self.pool.commit(pending, lease=leased)
        except AssertionError:    # a broken cache: goes up (counted as a background failure)
            raise
        except Exception:     # written but not committed: never left PENDING for waiters
            self.pool.abort(pending)
            self._failed("prefills_failed", "user %d's pre-inferred prefix could not be "
                         "committed", user)

    def abandon(self, pid: PrefixId) -> bool:
        """The ranking leg of ``pid``'s pre-infer will not come here (shed, failed over, its
        request failed): its footprint is freed now. A job not started (and waited on by no
        ranking request) is cancelled, its PENDING entry freed: nothing was spent on it. A
        started one finishes (its rounds are spent; the user's retry, sent here by affinity,
        or next visit may use it) and commits unleased: IDLE, evictable. A complete entry not
        in use loses its lease. Returns whether anything changed (counted)."""
        user = pid.user_id
        info = self.pool.lookup(user)
        if info is None or info.pid != pid:
            return False                      # gone, replaced, or a reload (a short copy)
        if info.state is EntryState.PENDING:
            work = self._inflight.get(user)
            if work is None or work.waiters or user not in self._reserved \
                    or user in self._unleased:
                return False           # waited on, a reload's extension, or abandoned already
            if work.rounds == 0 and self.scheduler.cancel_prefill(work):
                self.counters.preinfers_cancelled += 1
                self.pool.abort(self._reserved.pop(user))    # ``_settle`` finds it done
                return True
            self._unleased.add(user)
            self.counters.preinfers_unleased += 1
            return True
        if info.state is EntryState.READY and not info.in_use and self.pool.end_lease(pid):
            self.counters.preinfers_unleased += 1
            return True
        return False

    def start_reload(self, spec: PrefixSpec, base: PrefixId) -> bool:
        """Start reloading ``base`` from the host into the device as ``spec`` (the copy and
        extension run in the background); whether it started. It does not when the device
        pool refuses the entry, another prefix of the user is loading, or the host's copy
        expired meanwhile (the expander counts which). The caller has found ``spec``'s
        prefix neither on the device nor loading (``resident``), with nothing awaited since."""
        assert self.expander is not None
        load = self.expander.start(spec.pid, base, self._extension_for(spec, base))
        if load.done():
            outcome = load.result()
            assert outcome in _NOT_STARTED, f"{spec.pid} was resident after all: {outcome}"
            return False
        self.counters.reloads_started += 1
        self.spawn(self._reloaded(spec.pid, load))
        return True

    async def _reload(self, spec: PrefixSpec, base: PrefixId) -> ReloadOutcome:
        assert self.expander is not None
        return await self._reloaded(
            spec.pid, self.expander.start(spec.pid, base, self._extension_for(spec, base)))

    def _extension_for(self, spec: PrefixSpec, base: PrefixId
                       ) -> Callable[[PrefixKV], Awaitable[PrefixKV]] | None:
        """What extends a reload of ``base`` to ``spec``: None when it is the whole prefix."""
        if base.num_tokens >= spec.num_tokens:
            return None

        async def extend(past: PrefixKV) -> PrefixKV:
            return await self._extension(spec, base.num_tokens, past)
        return extend

    async def _reloaded(self, pid: PrefixId, load: Awaitable[ReloadOutcome]) -> ReloadOutcome:
        """``load``'s outcome, the entry marked as the host's once loaded."""
        outcome = await load
        if outcome is ReloadOutcome.LOADED:
            self._from_host[pid.user_id] = pid
        return outcome

    async def _extension(self, spec: PrefixSpec, start: int, past: PrefixKV) -> PrefixKV:
        ts = None if spec.timestamps is None else spec.timestamps[start:]
        job = self.model.prefill_job([PrefillInput(spec.items[start:], ts, past)])
        track = job.tracks[0]
        work = self.scheduler.submit_prefill(job.step, lambda: job.done, track.tail)
        # a ranking request waiting on this reload puts the extension on the critical path:
        # the scheduler runs it before pre-infers nobody waits on, as it does a waited-on one
        work.waiters += self._waiting.get(spec.pid.user_id, 0)
        self._inflight[spec.pid.user_id] = work
        try:
            tail: PrefixKV = await work.future
            return tail
        finally:
            if self._inflight.get(spec.pid.user_id) is work:
                del self._inflight[spec.pid.user_id]

    # ---- consuming entries -------------------------------------------------------------------
    async def find(self, spec: PrefixSpec) -> tuple[PrefixKV | None, RankPath]:
        """A pinned view of ``spec``'s prefix and how it was found, or (None, FULL). The
        request is counted once in each tier's lookups (``TierStats``), once its path is
        known: on the device a hit when it ranks from K/V computed there ahead of it
        (DEVICE_HIT, PENDING_WAIT), else a miss (stale when the device held another prefix of
        the user); on the host, for a request the device did not serve, a hit when it ranks
        from the host's copy (HOST_HIT), else a miss (stale when the host's copy was no prefix
        of this one). So each tier's hits and misses add up to the requests it was asked for."""
        held = self.pool.lookup(spec.pid.user_id)        # as the request found the device
        kv, path, host = await self._find(spec)
        self._count(path, held is not None and held.pid != spec.pid, host)
        return kv, path

    async def _find(self, spec: PrefixSpec) -> tuple[PrefixKV | None, RankPath, Lookup]:
        """``find``'s view and path, and what the host held for ``spec`` (``_host_copy``;
        MISS when it was not asked)."""
        pid = spec.pid
        kv = self.pool.acquire(pid, counted=False)      # counted by ``find``, once
        if kv is not None:
            return kv, self._path(pid, RankPath.DEVICE_HIT), Lookup.MISS
        if self.resident(pid) is EntryState.PENDING:
            return (*await self._wait(pid), Lookup.MISS)
        base, host = self._host_copy(spec)
        if base is not None:
            outcome = await self._waiting_on(pid, self._loaded(pid, self._reload(spec, base)))
            if outcome is None:
                return None, RankPath.FULL, host
            if outcome is ReloadOutcome.PENDING:
                return (*await self._wait(pid), host)
            kv = self.pool.acquire(pid, counted=False)
            if kv is not None:
                return kv, RankPath.HOST_HIT, host
        return None, RankPath.FULL, host

    def _count(self, path: RankPath, stale_on_device: bool, host: Lookup) -> None:
        """Count a ranking request's lookups in the tiers (``find``)."""
        if path is RankPath.DEVICE_HIT or path is RankPath.PENDING_WAIT:
            self.pool.count_lookup(Lookup.HIT)
            return
        self.pool.count_lookup(Lookup.STALE_MISS if stale_on_device else Lookup.MISS)
        if self.host is not None:
            self.host.count_lookup(Lookup.HIT if path is RankPath.HOST_HIT else
                                   Lookup.STALE_MISS if host is Lookup.STALE_MISS else
                                   Lookup.MISS)

    async def _wait(self, pid: PrefixId) -> tuple[PrefixKV | None, RankPath]:
        self.counters.waits += 1
        work = self._inflight.get(pid.user_id)
        if work is not None:
            work.waiters += 1            # its prefix is on the critical path now
        loading = self.expander is not None and self.expander.loading(pid.user_id) == pid
        if loading:
            assert self.expander is not None
            # joins the load in flight (its extension, once queued, counts this request)
            joined = self._loaded(pid, self.expander.reload(pid, pid))
            if await (joined if work is not None else self._waiting_on(pid, joined)) is None:
                return None, RankPath.FULL
        elif not await self.pool.wait_settled(pid):
            return None, RankPath.FULL
        kv = self.pool.acquire(pid, counted=False)
        return (kv, self._path(pid, RankPath.PENDING_WAIT)) if kv is not None \
            else (None, RankPath.FULL)

    async def _waiting_on(self, pid: PrefixId,
                          load: Awaitable[ReloadOutcome | None]) -> ReloadOutcome | None:
        """``load``, with this ranking request counted as a waiter of the user's extension job
        should one be queued meanwhile (``_extension``)."""
        user = pid.user_id
        self._waiting[user] = self._waiting.get(user, 0) + 1
        try:
            return await load
        finally:
            left = self._waiting.pop(user) - 1
            if left:
                self._waiting[user] = left

    async def _loaded(self, pid: PrefixId,
                      load: Awaitable[ReloadOutcome]) -> ReloadOutcome | None:
        """``load``'s outcome, or None where the reload (or its extension) failed: counted,
        and logged the first few times (a fault that repeats would flood the log); the request
        then computes the prefix in full. A stopped instance (the fleet answers elsewhere) and
        a broken cache's ``AssertionError`` go up."""
        try:
            return await load
        except (InstanceStoppedError, AssertionError):
            raise
        except Exception:
            self._failed("reloads_failed", "the reload of user %d's prefix failed; ranking it "
                         "in full", pid.user_id)
            return None

    def _failed(self, counter: str, message: str, *args: object) -> None:
        """Count a failure the request degrades around (``counter``, a ``ResidencyCounters``
        field); the first few of each kind are logged with the exception being handled."""
        count = getattr(self.counters, counter) + 1
        setattr(self.counters, counter, count)
        if count <= _LOGGED_FAILURES:
            log.warning(message, *args, exc_info=True)

    def _path(self, pid: PrefixId, otherwise: RankPath) -> RankPath:
        return RankPath.HOST_HIT if self._from_host.get(pid.user_id) == pid else otherwise

    async def finish_cached(self, pid: PrefixId, grown: PrefixId | None,
                            computed: PrefixKV | None) -> None:
        """After ranking from the cache: demote (prefix + suffix when given), release."""
        if self._from_host.get(pid.user_id) == pid:
            del self._from_host[pid.user_id]
        if self.expander is None:
            self.pool.release(pid)
            if not self.reuse:
                self.pool.discard(pid)
            return
        extended = ExtendedPrefix(grown, computed) if grown is not None and computed else None
        await self.expander.release(pid, extended=extended)

    async def fill(self, pid: PrefixId, kv: PrefixKV) -> None:
        """Keep the K/V a full pass computed as ``pid``: IDLE on the device (no one waits for
        it), and on the host. Copies run on the copier thread, bookkeeping on the loop."""
        if not self.reuse:
            return
        if self.resident(pid) is None:
            pending = self.pool.begin(pid, timed=kv.has_timestamps)
            if pending is None:
                self.counters.fill_refused += 1
            else:
                self._from_host.pop(pid.user_id, None)   # computed here, not reloaded
                entry = pending           # not Optional: what the commit closes over
                await self._copy(self.pool, entry, kv,
                                 lambda: self.pool.commit(entry, lease=False))
                self.counters.fills += 1
        if self.host is None:
            return
        held = self.host.info(pid.user_id)
        if held is not None and held.pid == pid:
            self.host.refresh(pid)
            return
        host_pending = self.host.begin(pid, timed=kv.has_timestamps)
        if host_pending is not None:
            host = self.host
            await self._copy(host, host_pending, kv, lambda: host.commit(host_pending))

    async def _copy(self, tier: DeviceKVPool | HostKVTier, pending: PendingEntry,
                    kv: PrefixKV, commit: Callable[[], None]) -> None:
        """Write ``kv`` into ``pending`` on the copier, then ``commit``; on any failure of
        either the entry is aborted (never left PENDING)."""
        try:
            await self.copier.run(lambda: tier.write(pending, kv))
            commit()
        except BaseException:
            tier.abort(pending)
            raise
