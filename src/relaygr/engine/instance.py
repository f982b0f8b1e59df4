"""A ranking instance: one device's model, KV pool, host tier and scheduler.

The two legs of the relay arrive here (the router sends both of a request's legs to the same
instance):

* ``preinfer(spec, ...)`` (first leg, while retrieval and pre-processing run elsewhere): asks the
  trigger whether this prefix is worth pre-inferring and, if so, starts a chunked pre-infer job
  or a reload from the host tier. Returns at once; the work proceeds in the background.
* ``abandon(pid)``: that pre-infer's ranking leg will not come here (it was shed or failed
  over): its job is cancelled if not started, its lease ended, so its footprint is free.
* ``rank(job)`` (second leg, the critical path): ranks against the resident prefix (waiting for
  it if it is still being computed, reloading it if only the host has it) or, on a miss, with a
  full pass (or the configured truncation). Every request gets an answer; the path is recorded.

Failure model: ``fail()`` stops the instance and drops its caches (device memory is gone);
queued and later work raises ``InstanceStoppedError`` so the cascade can answer elsewhere.
``restart()`` brings it back empty. Any other error of a ranking pass reaches the caller as it
is; the cascade decides whose fault it is (``cascade.fleet.failover_for``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from relaygr.engine.executor import ComputeExecutor
from relaygr.engine.residency import Residency
from relaygr.engine.scheduler import (
    BatchPolicy,
    BatchTiming,
    InstanceScheduler,
    InstanceStoppedError,
)
from relaygr.engine.snapshot import InstanceSnapshot, TierSnapshot
from relaygr.engine.types import (
    PrefixSpec,
    PreinferAction,
    PreinferResult,
    RankJob,
    RankPath,
    RankResult,
    RankTiming,
)
from relaygr.errors import ConfigError
from relaygr.kvcache import DeviceKVPool, EntryState, HostKVTier, KVLayout, PrefixId
from relaygr.model import HSTU, PrefixKV, RankInput, RankOutput
from relaygr.relay.trigger import (
    InstanceLoad,
    PoolUsage,
    Trigger,
    TriggerReason,
    TriggerRequest,
)
from relaygr.settings import require_positive_ints

log = logging.getLogger("relaygr.engine.instance")


@dataclass(frozen=True)
class InstanceConfig:
    """Resources and policies of one instance (a system's instances share one; each is named and
    placed on its device by whoever builds it). Byte budgets of 0 turn a tier off."""

    # Sized for a few hundred long prefixes of the default CPU model (a server sizes its
    # budgets from its model and users instead: kvcache.sizing).
    device_budget_bytes: int = 512 << 20
    host_budget_bytes: int = 2048 << 20
    page_tokens: int = 64
    # A pre-inferred prefix is reserved for its ranking request this long (the cascade's
    # retrieval + pre-processing take ~tens of ms, so one unclaimed after 2 s never will be);
    # then it becomes evictable.
    lease_s: float = 2.0
    # How long a demoted prefix stays useful on the host (revisits within minutes).
    host_ttl_s: float = 600.0
    batch: BatchPolicy = field(default_factory=BatchPolicy)
    # None: recompute the whole prefix on a miss (exact). N: keep only the last N prefix events
    # (what production does today; scores then differ, and the path says "truncated").
    truncate_to_tokens: int | None = None
    # False: the relay works only within one request (MLPerf's closed rules): no host tier, no
    # cache fill at ranking time, and a prefix is freed once its own ranking consumed it.
    cross_request_reuse: bool = True

    def __post_init__(self) -> None:
        for name in ("device_budget_bytes", "host_budget_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"InstanceConfig.{name} must be >= 0")
        require_positive_ints(self, "page_tokens")
        for name in ("lease_s", "host_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"InstanceConfig.{name} must be > 0")
        if self.truncate_to_tokens is not None and self.truncate_to_tokens <= 0:
            raise ConfigError("InstanceConfig.truncate_to_tokens must be positive when given")


class RankingInstance:
    """See the module docstring. Not thread-safe: one event loop drives it."""

    def __init__(self, name: str, device: str, config: InstanceConfig, model: HSTU,
                 trigger: Trigger | None) -> None:
        self.name, self.config, self.model, self.trigger = name, config, model, trigger
        self.device = torch.device(device)
        self.paths: Counter[str] = Counter()
        self.preinfer_actions: Counter[str] = Counter()
        self.healthy = False
        # 0: every ranking batch computes on the worker thread (``rank_short_on_loop``).
        self.loop_rank_elems = 0
        self._build()

    def _build(self) -> None:
        self._install(self._make_parts())

    def _make_parts(self) -> tuple[ComputeExecutor, ComputeExecutor, InstanceScheduler,
                                   Residency | None]:
        """A fresh executor, copier, scheduler and (when budgeted) cache tiers. Touches no
        state of ``self``, so a restart can allocate the arenas off the event loop."""
        cfg = self.config
        executor = ComputeExecutor(self.name, self.device)
        copier = ComputeExecutor(f"{self.name}-copy", self.device)
        scheduler = InstanceScheduler(executor, self.model.rank_batch_outputs, cfg.batch,
                                      self.loop_rank_elems)
        residency: Residency | None = None
        if cfg.device_budget_bytes:
            layout = KVLayout.for_model(self.model.cfg, self.model.dtype)
            pool = DeviceKVPool(layout, cfg.device_budget_bytes, page_tokens=cfg.page_tokens,
                                lease_s=cfg.lease_s, device=self.device)
            host = None
            if cfg.host_budget_bytes:
                host = HostKVTier(layout, cfg.host_budget_bytes, cfg.host_ttl_s,
                                  page_tokens=cfg.page_tokens,
                                  pin_memory=self.device.type == "cuda")
            residency = Residency(self.model, pool, host, scheduler, copier,
                                  reuse=cfg.cross_request_reuse)
        return executor, copier, scheduler, residency

    def _install(self, parts: tuple[ComputeExecutor, ComputeExecutor, InstanceScheduler,
                                    Residency | None]) -> None:
        self.executor, self.copier, self.scheduler, self.residency = parts

    def rank_short_on_loop(self, max_elems: int) -> None:
        """Run cached ranking batches of at most ``max_elems`` attention scores per layer on
        the event loop's thread (``engine.scheduler``): only for a loop that serves nothing but
        instances (``engine.transport.host``). Kept across ``restart``."""
        if max_elems < 0:
            raise ConfigError("the loop's ranking batch bound must be >= 0")
        self.loop_rank_elems = max_elems
        self.scheduler.loop_rank_elems = max_elems

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.scheduler.start()
        self.healthy = True

    async def stop(self) -> None:
        self.healthy = False
        await self.scheduler.stop()
        if self.residency is not None and self.residency.background:
            await asyncio.gather(*self.residency.background, return_exceptions=True)
        self.executor.shutdown()
        self.copier.shutdown()
        if self.residency is not None and self.residency.expander is not None:
            self.residency.expander.close()

    async def fail(self) -> None:
        """Simulate losing the device: stop, and forget every cached prefix."""
        await self.stop()
        self.residency = None

    async def restart(self) -> None:
        """Come back with empty caches (a replacement device). The new arenas (hundreds of MB
        of zeroed memory) are allocated on a helper thread, so serving goes on meanwhile."""
        self._install(await asyncio.to_thread(self._make_parts))
        await self.start()

    @property
    def queue_depth(self) -> int:
        """All queued work, ranking and pre-infer (what ``idle`` waits out). Not the router's
        load signal: that is ``rank_queue_depth``."""
        return self.scheduler.rank_queue_depth + self.scheduler.prefill_queue_depth

    @property
    def rank_queue_depth(self) -> int:
        return self.scheduler.rank_queue_depth

    def snapshot(self) -> InstanceSnapshot:
        """The instance's figures now (on the event loop, as every cache operation). Leases end
        lazily; a lease past its deadline is ended first, so the device's unevictable bytes and
        READY entries are the live ones (as the host tier's stats expire its copies)."""
        res = self.residency
        device = host = None
        residency: dict[str, int] = {}
        expander: dict[str, int] = {}
        if res is not None:
            res.pool.expire_leases()
            device = TierSnapshot.of(res.pool.stats)
            host = None if res.host is None else TierSnapshot.of(res.host.stats)
            residency = {k: v for k, v in asdict(res.counters).items() if isinstance(v, int)}
            if res.expander is not None:
                expander = {k: v for k, v in asdict(res.expander.stats).items()
                            if isinstance(v, int)}
        sched = self.scheduler.stats
        compute = {"rank_batches": float(sched.rank_batches),
                   "rank_batches_on_loop": float(sched.rank_batches_on_loop),
                   "rank_requests": float(sched.rank_requests),
                   "rank_batches_split": float(sched.rank_batches_split),
                   "rank_requests_failed": float(sched.rank_requests_failed),
                   "prefill_rounds": float(sched.prefill_rounds),
                   "rank_compute_s": sched.rank_compute_s,
                   "prefill_compute_s": sched.prefill_compute_s}
        trigger = {} if self.trigger is None else \
            {reason.value: n for reason, n in self.trigger.counts.items()}
        return InstanceSnapshot(self.name, self.healthy, self.scheduler.rank_queue_depth,
                                self.scheduler.prefill_queue_depth, device, host,
                                dict(self.paths), dict(self.preinfer_actions), trigger,
                                residency, compute, expander)

    async def idle(self) -> None:
        """Wait until the background work (pre-infer, demotion, fills) and the queues are done."""
        while True:
            res = self.residency
            pending = [] if res is None else list(res.background)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            elif self.queue_depth:
                await asyncio.sleep(0.001)
            else:
                return

    async def check_integrity(self) -> None:
        """The cache tiers' accounting is consistent (raises AssertionError otherwise)."""
        res = self.residency
        if res is not None:
            res.pool.check_integrity()
            if res.host is not None:
                res.host.check_integrity()

    # ---- first leg: the pre-infer signal -----------------------------------------------------
    def preinfer(self, spec: PrefixSpec, suffix_tokens: int, candidates: int) -> PreinferResult:
        result = self._preinfer(spec, suffix_tokens, candidates)
        self.preinfer_actions[result.action.value] += 1
        return result

    def _preinfer(self, spec: PrefixSpec, suffix_tokens: int, candidates: int) -> PreinferResult:
        res = self.residency
        if not self.healthy or res is None or self.trigger is None:
            return PreinferResult(PreinferAction.SKIPPED, None, 0)
        # Leases end lazily, at the pool's ``begin``; a lease whose ranking leg never came (shed,
        # failed over) would otherwise count as unevictable here, and a trigger that refuses on
        # that footprint never reaches ``begin``: pre-inference would stay off for good.
        res.pool.expire_leases()
        state = res.resident(spec.pid)
        if state is EntryState.PENDING:
            return PreinferResult(PreinferAction.IN_FLIGHT, None, 0)
        if state is not None:
            # leased for this request's ranking leg, as a fresh pre-infer would be: an IDLE
            # entry is the LRU's to evict before that leg comes
            res.pool.lease(spec.pid)
            return PreinferResult(PreinferAction.ON_DEVICE, None, 0)
        base = res.host_base(spec)
        per_token = PrefixKV.bytes_per_token(self.model.cfg.num_layers, self.model.cfg.dim,
                                             self.model.dtype, spec.timestamps is not None)
        request = TriggerRequest(spec.pid.user_id, spec.num_tokens, suffix_tokens, candidates,
                                 spec.num_tokens * per_token, host_has_prefix=base is not None)
        decision = self.trigger.decide(
            request, PoolUsage(res.pool.unevictable_bytes, res.pool.budget_bytes),
            InstanceLoad(self.scheduler.rank_busy.fraction()))
        if decision.reason is TriggerReason.HOST_HIT and base is not None:
            return self._reload(res, spec, base, decision.reason)
        if not decision.admit:
            return PreinferResult(PreinferAction.SKIPPED, decision.reason, 0)
        try:
            started = res.start_prefill(spec)
        except Exception:    # the signal is advisory: ranking computes the prefix in full
            log.warning("%s: the pre-infer of user %d could not start", self.name,
                        spec.pid.user_id, exc_info=True)
            self.trigger.withdraw(request)
            return PreinferResult(PreinferAction.FAILED, decision.reason, 0)
        if not started:
            self.trigger.withdraw(request)
            return PreinferResult(PreinferAction.REFUSED, decision.reason, 0)
        return PreinferResult(PreinferAction.PREFILL, decision.reason, spec.num_tokens)

    def abandon(self, pid: PrefixId) -> bool:
        """The ranking leg of ``pid``'s pre-infer will not come here (shed, failed over): free
        its footprint now (``Residency.abandon``: a job not started is cancelled, a started or
        complete one is kept unleased). Whether anything changed."""
        res = self.residency
        return self.healthy and res is not None and res.abandon(pid)

    def _reload(self, res: Residency, spec: PrefixSpec, base: PrefixId,
                reason: TriggerReason) -> PreinferResult:
        """The host-hit pre-infer: RELOAD only when the copy started; REFUSED when the device
        could not take it (its pool refused the entry, another prefix of the user is loading,
        or the host's copy expired meanwhile), FAILED when starting it raised."""
        try:
            started = res.start_reload(spec, base)
        except (InstanceStoppedError, AssertionError):
            raise
        except Exception:    # the signal is advisory: ranking computes the prefix in full
            log.warning("%s: the reload of user %d could not start", self.name,
                        spec.pid.user_id, exc_info=True)
            return PreinferResult(PreinferAction.FAILED, reason, 0)
        if not started:
            return PreinferResult(PreinferAction.REFUSED, reason, 0)
        return PreinferResult(PreinferAction.RELOAD, reason, spec.num_tokens - base.num_tokens)

    # ---- second leg: ranking -----------------------------------------------------------------
    async def rank(self, job: RankJob) -> RankResult:
        """Scores for ``job`` (raises ``InstanceStoppedError`` if this instance is down)."""
        if not self.healthy:
            raise InstanceStoppedError(f"{self.name} is down")
        res = self.residency
        entered = time.perf_counter()
        kv, path = (None, RankPath.FULL) if res is None else await res.find(job.prefix)
        found = time.perf_counter()
        if kv is not None:
            request = RankInput(job.candidates, prefix=kv, suffix_items=job.suffix_items,
                                suffix_timestamps=job.suffix_timestamps,
                                query_timestamp=job.query_ts)
            cost = int(job.candidates.numel()) + job.suffix_tokens
            # the candidates' scores against the prefix (and the suffix's own, far fewer)
            elems: int | None = int(job.candidates.numel()) * (kv.num_tokens + job.suffix_tokens)
        else:
            request, path = self._uncached_request(job)
            cost = int(job.candidates.numel()) + job.suffix_tokens + job.prefix.num_tokens
            elems = None
        batch = BatchTiming()
        try:
            out: RankOutput = await self.scheduler.submit_rank(request, cost, batch, elems)
        except BaseException:
            if kv is not None and res is not None and self.residency is res:
                res.pool.release(job.prefix.pid)
            raise
        self.paths[path.value] += 1
        if res is not None and self.residency is res:
            self._after_rank(res, job, kv is not None, path, out)
        timing = RankTiming(found - entered, batch.queue_s, batch.compute_s, batch.batch_size,
                            time.perf_counter() - entered)
        return RankResult(out.scores, path, self.name, timing)

    def _uncached_request(self, job: RankJob) -> tuple[RankInput, RankPath]:
        items, ts = job.prefix.items, job.prefix.timestamps
        limit = self.config.truncate_to_tokens
        path = RankPath.FULL
        if limit is not None and items.numel() > limit:
            items, ts = items[-limit:], None if ts is None else ts[-limit:]
            path = RankPath.TRUNCATED
        request = RankInput(job.candidates, prefix_items=items, prefix_timestamps=ts,
                            suffix_items=job.suffix_items,
                            suffix_timestamps=job.suffix_timestamps,
                            query_timestamp=job.query_ts)
        return request, path

    def _after_rank(self, res: Residency, job: RankJob, cached: bool, path: RankPath,
                    out: RankOutput) -> None:
        """Background work off the critical path: demote and release, or fill the cache."""
        if cached:
            work = res.finish_cached(job.prefix.pid, job.grown, out.computed)
        elif path is RankPath.FULL and out.computed is not None:
            key = job.grown if job.grown is not None else job.prefix.pid
            work = res.fill(key, out.computed)
        else:
            return
        res.spawn(work)
