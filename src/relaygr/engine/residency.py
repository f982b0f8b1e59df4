"""Where a user's prefix K/V lives on one instance, and moving it there.

``Residency`` wraps the instance's device pool, its host tier and their expander, and speaks in
requests rather than cache operations. Its producing side (``engine.producer.PrefixProducer``:
``start_prefill``, ``start_reload``, ``abandon``) writes prefixes there; this is the ranking
request's side:

* ``find(spec)``: for a ranking request, a pinned device view of exactly this prefix, waiting
  on a pre-infer in flight or reloading (and extending) a shorter host copy; None on a miss,
  and None when that reload or its extension fails (counted in ``reloads_failed``): the request
  then computes its prefix in full, a slower correct answer. It counts the request once in
  each tier's hits and misses, by the path it took.
* ``finish_cached(...)``: after a cached ranking, release the entry and demote prefix + ranked
  suffix to host; ``fill(...)``: after a full pass, keep what it computed (cache fill at ranking
  time).

Every cache operation runs on the event loop; tensor copies into a PENDING entry run on the
instance's workers (the cache's threading contract allows it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from relaygr.engine.producer import PrefixProducer
from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.types import PrefixSpec, RankPath
from relaygr.kvcache import (
    DeviceKVPool,
    EntryState,
    ExtendedPrefix,
    HostKVTier,
    Lookup,
    PendingEntry,
    PrefixId,
    ReloadOutcome,
)
from relaygr.model import PrefixKV


class Residency(PrefixProducer):
    """Device pool + optional host tier of one instance (see the module docstring)."""

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

    def _path(self, pid: PrefixId, otherwise: RankPath) -> RankPath:
        return RankPath.HOST_HIT if self._from_host.get(pid.user_id) == pid else otherwise

    async def finish_cached(self, pid: PrefixId, grown: PrefixId | None,
                            computed: PrefixKV | None) -> None:
        """After ranking from the cache: demote (as ``grown``, the prefix followed by the K/V
        the pass kept, when given), release."""
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
