"""What puts a user's prefix K/V on one instance's device: the producing side of a residency.

``PrefixProducer`` holds the instance's device pool, its host tier and their expander, and the
jobs that write prefixes into them (``engine.residency.Residency`` adds the ranking request's
side, finding and finishing):

* ``start_reload(spec, base)``: bring a host copy back (extended with the newer events), in the
  background; whether the copy started (a pre-infer's action says so).
* ``start_prefill(spec)``: reserve the entry and queue a chunked pre-infer job on the scheduler;
  a job that cannot even be built (an input the model refuses, no memory for its tensors)
  aborts the entry it reserved before the error goes up, so nothing waits on it.
* ``abandon(pid)``: the pre-infer's ranking leg will not come here (shed, failed over): a job
  not started yet is cancelled and its entry freed; one started finishes as an IDLE entry, and
  a complete one's lease ends, so neither counts against the footprint any more.

Every cache operation runs on the event loop; tensor copies into a PENDING entry run on the
instance's workers (the cache's threading contract allows it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass

from relaygr.engine.executor import ComputeExecutor
from relaygr.engine.scheduler import InstanceScheduler, InstanceStoppedError, PrefillWork
from relaygr.engine.types import PrefixSpec
from relaygr.kvcache import (
    DeviceKVPool,
    EntryState,
    Expander,
    HostKVTier,
    Lookup,
    PendingEntry,
    PrefixId,
    ReloadOutcome,
)
from relaygr.model import HSTU, PrefillInput, PrefixKV

log = logging.getLogger("relaygr.engine.residency")
# Failures of each kind (``PrefixProducer._failed``) logged with their traceback per instance; the
# rest are counted only (a fault that repeats would flood the log).
_LOGGED_FAILURES = 5
# What keeps a pre-infer's reload from starting, its prefix being neither on the device nor
# loading (``PrefixProducer.start_reload``).
_NOT_STARTED = (ReloadOutcome.BUSY, ReloadOutcome.REFUSED, ReloadOutcome.HOST_MISS)


@dataclass
class ResidencyCounters:
    """What one instance's residency did, cumulative (copied into its snapshots)."""

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


class PrefixProducer:
    """Device pool + optional host tier of one instance, and the jobs that write prefixes
    into them (see the module docstring)."""

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

    def _failed(self, counter: str, message: str, *args: object) -> None:
        """Count a failure the request degrades around (``counter``, a ``ResidencyCounters``
        field); the first few of each kind are logged with the exception being handled."""
        count = getattr(self.counters, counter) + 1
        setattr(self.counters, counter, count)
        if count <= _LOGGED_FAILURES:
            log.warning(message, *args, exc_info=True)

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
            job = self.model.prefill_job([PrefillInput(spec.items, spec.timestamps,
                                                       next_timestamp=spec.next_timestamp)])
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
        job = self.model.prefill_job([PrefillInput(spec.items[start:], ts, past,
                                                   spec.next_timestamp)])
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
