"""The instance scheduler: ranking is the critical path, pre-inference fills the gaps.

Each turn of the loop runs exactly one unit of compute on the instance's executor:
  1. if ranking work is queued, one batch of it (``BatchPolicy`` decides how much);
  2. otherwise one chunk round of one pre-infer job: the job a ranking request is waiting on
     first (its prefix is now on the critical path), then the earliest-submitted.
Exception to 1: a pre-infer job that a ranking request waits on is itself ranking work, so
after each ranking batch it gets one round (turns alternate while both are pending); without
this, steady ranking traffic would starve it and its waiting request without bound.
So a ranking request never waits behind more than one pre-infer chunk, whose size the model
bounds (``HSTUConfig.query_block`` / ``score_block_elems``).

Short ranking batches may run on the loop's own thread (``ComputeExecutor.run_here``): when
``loop_rank_elems`` is set (by a process whose loop serves only its instances) and every request
of the batch says how many attention scores its pass computes per layer (``RankWork.elems``: a
cached pass, whose size is known), a batch of at most ``loop_rank_elems`` scores in all runs
there, and the loop then yields once so the batch's replies go out before the next unit starts.
Everything else (full passes, pre-infer rounds) runs on the worker, so the loop stays free to
read and answer during long work.

A batch that raises is run again one request at a time, so a request that cannot be ranked
(an input the model refuses, a pass too large for the device) fails alone, never the others
merged with it; their retries are counted (``SchedulerStats.rank_batches_split``).

Invariants: futures are resolved only on the event loop; a failed request fails exactly its own
future; ``stop()`` fails every queued future with ``InstanceStoppedError``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relaygr.engine.executor import ComputeExecutor
from relaygr.errors import RelayGRError
from relaygr.settings import require_positive_ints


class InstanceStoppedError(RelayGRError):
    """The instance stopped (failed or shut down) before this work ran."""


@dataclass
class BatchTiming:
    """Filled in by the scheduler when a ranking request's batch has run (seconds)."""

    queue_s: float = 0.0        # submitted -> its batch started
    compute_s: float = 0.0      # the batch's compute
    batch_size: int = 0


@dataclass
class RankWork:
    """One ranking request queued for a batch; ``cost_tokens`` sizes batches; ``elems``: the
    attention scores per layer of its pass, where known (None: never run on the loop)."""

    payload: Any
    cost_tokens: int
    future: asyncio.Future[Any]
    submitted_s: float = 0.0
    timing: BatchTiming | None = None
    elems: int | None = None


@dataclass
class PrefillWork:
    """A resumable pre-infer job: ``step()`` computes one chunk round, ``done`` says when to stop.

    ``finish()`` runs on the worker after the last round (e.g. writing K/V into the pool) and
    its return value resolves ``future``.
    """

    step: Callable[[], None]
    is_done: Callable[[], bool]
    finish: Callable[[], Any]
    future: asyncio.Future[Any]
    seq: int = 0
    waiters: int = 0              # ranking requests blocked on this prefix
    rounds: int = 0


@dataclass(frozen=True)
class BatchPolicy:
    """How much queued ranking work one model call takes.

    Batching never waits for more work (no batching delay): it only merges requests already
    queued when the instance frees up, which cuts per-call overhead without delaying the head of
    the queue by more than the batch's own compute. ``max_requests=1`` disables batching.
    """

    max_requests: int = 4
    max_tokens: int = 1 << 16   # sum of cost_tokens in one batch

    def __post_init__(self) -> None:
        require_positive_ints(self, "max_requests", "max_tokens")

    def take(self, queue: deque[RankWork]) -> list[RankWork]:
        batch = [queue.popleft()]
        tokens = batch[0].cost_tokens
        while queue and len(batch) < self.max_requests:
            if tokens + queue[0].cost_tokens > self.max_tokens:
                break
            work = queue.popleft()
            tokens += work.cost_tokens
            batch.append(work)
        return batch


class BusyMeter:
    """The share of the last ``window_s`` seconds spent in one kind of work, counting the call
    in flight. The caller runs its calls one at a time (``start`` then ``end``), so intervals
    never overlap and the fraction is in [0, 1]. Not thread-safe: one event loop drives it.
    """

    def __init__(self, window_s: float = 2.0, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s, self.clock = window_s, clock
        self._done: deque[tuple[float, float]] = deque()
        self._running_since: float | None = None

    def start(self) -> None:
        assert self._running_since is None, "BusyMeter.start while a call is running"
        self._running_since = self.clock()

    def end(self) -> None:
        assert self._running_since is not None, "BusyMeter.end without start"
        self._done.append((self._running_since, self.clock()))
        self._running_since = None

    def fraction(self) -> float:
        now = self.clock()
        horizon = now - self.window_s
        while self._done and self._done[0][1] <= horizon:
            self._done.popleft()
        busy = sum(end - max(start, horizon) for start, end in self._done)
        if self._running_since is not None:
            busy += now - max(self._running_since, horizon)
        return min(1.0, busy / self.window_s)


@dataclass
class SchedulerStats:
    rank_batches: int = 0
    rank_requests: int = 0
    prefill_rounds: int = 0
    prefill_jobs_done: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    rank_compute_s: float = 0.0       # worker seconds spent in ranking batches
    rank_batches_on_loop: int = 0     # of rank_batches, run on the loop's thread
    rank_batches_split: int = 0       # failed batches run again one request at a time
    rank_requests_failed: int = 0     # requests whose pass raised (alone, or in a batch of 1)
    prefill_compute_s: float = 0.0    # worker seconds spent in pre-infer rounds


class InstanceScheduler:
    """Orders one instance's compute (see the module docstring)."""

    def __init__(self, executor: ComputeExecutor, run_batch: Callable[[list[Any]], list[Any]],
                 batch_policy: BatchPolicy | None = None, loop_rank_elems: int = 0) -> None:
        """``loop_rank_elems``: the largest ranking batch (attention scores per layer) run on
        the loop's thread; 0 runs every batch on the worker (see the module docstring)."""
        self.executor = executor
        self.loop_rank_elems = loop_rank_elems
        self.run_batch = run_batch
        self.batch_policy = batch_policy or BatchPolicy()
        self.stats = SchedulerStats()
        # The share of recent time spent ranking: what a new ranking request queues behind
        # (pre-infer yields to it after at most one chunk, so it is not counted).
        self.rank_busy = BusyMeter(clock=executor.clock)
        self._rank_queue: deque[RankWork] = deque()
        self._prefills: list[PrefillWork] = []
        self._running_prefill: PrefillWork | None = None    # its round is on the worker now
        self._seq = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    # ---- load signals ------------------------------------------------------------------------
    @property
    def rank_queue_depth(self) -> int:
        return len(self._rank_queue)

    @property
    def prefill_queue_depth(self) -> int:
        return len(self._prefills)

    def loop_ended(self) -> str | None:
        """Why the loop ended though the scheduler was not stopped (the error it raised), or
        None while it runs (or before ``start``, or after ``stop``). Work queued on a loop
        that ended waits for ever."""
        task = self._task
        if task is None or self._stopped or not task.done():
            return None
        if task.cancelled():
            return "cancelled"
        error = task.exception()
        return "returned" if error is None else repr(error)

    @property
    def prefill_waiters(self) -> int:
        """Ranking requests waiting for a queued pre-infer job to finish."""
        return sum(w.waiters for w in self._prefills)

    # ---- submission --------------------------------------------------------------------------
    def start(self) -> None:
        assert self._task is None, "scheduler already started"
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def submit_rank(self, payload: Any, cost_tokens: int, timing: BatchTiming | None = None,
                    elems: int | None = None) -> asyncio.Future[Any]:
        """Queue one ranking request; ``timing``, when given, is filled in once it has run;
        ``elems``: its pass's attention scores per layer, where known (``RankWork.elems``)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._stopped:
            future.set_exception(InstanceStoppedError(f"{self.executor.name} is stopped"))
            return future
        self._rank_queue.append(RankWork(payload, cost_tokens, future, self.executor.clock(),
                                         timing, elems))
        self._wakeup.set()
        return future

    def submit_prefill(self, step: Callable[[], None], is_done: Callable[[], bool],
                       finish: Callable[[], Any]) -> PrefillWork:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        work = PrefillWork(step, is_done, finish, future, seq=next(self._seq))
        if self._stopped:
            future.set_exception(InstanceStoppedError(f"{self.executor.name} is stopped"))
            return work
        self._prefills.append(work)
        self._wakeup.set()
        return work

    # ---- the loop ----------------------------------------------------------------------------
    async def _loop(self) -> None:
        ranked_last = False
        while not self._stopped:
            if not self._rank_queue and not self._prefills:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            waited_on = ranked_last and any(w.waiters for w in self._prefills)
            if self._rank_queue and not waited_on:
                await self._run_rank_batch()
                ranked_last = True
            else:
                await self._run_prefill_round()
                ranked_last = False

    async def _run_rank_batch(self) -> None:
        batch = self.batch_policy.take(self._rank_queue)
        try:
            await self._compute_ranks(batch)
            return
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0], exc)
                return
        # one request's failure must not fail the others merged with it: each alone
        self.stats.rank_batches_split += 1
        for w in batch:
            if w.future.done():
                continue
            if self._stopped:        # as stop() fails queued work: the fleet fails it over
                w.future.set_exception(InstanceStoppedError(f"{self.executor.name} stopped"))
                continue
            try:
                await self._compute_ranks([w])
            except Exception as exc:
                self._fail(w, exc)

    def _fail(self, work: RankWork, exc: Exception) -> None:
        self.stats.rank_requests_failed += 1
        if not work.future.done():
            work.future.set_exception(exc)

    async def _compute_ranks(self, batch: list[RankWork]) -> None:
        """One model call over ``batch``, its futures resolved; raises what the call raised,
        leaving them unresolved."""
        payloads = [w.payload for w in batch]
        here = self._runs_here(batch)
        started = self.executor.clock()
        self.rank_busy.start()
        try:
            if here:
                results, seconds = self.executor.run_here(lambda: self.run_batch(payloads))
            else:
                results, seconds = await self.executor.run_timed(
                    lambda: self.run_batch(payloads))
            if len(results) != len(batch):
                raise RuntimeError(f"the ranking batch returned {len(results)} results for "
                                   f"{len(batch)} requests")
        finally:
            self.rank_busy.end()
        self.stats.rank_batches += 1
        self.stats.rank_compute_s += seconds
        self.stats.rank_requests += len(batch)
        self.stats.batch_sizes[len(batch)] = self.stats.batch_sizes.get(len(batch), 0) + 1
        for w in batch:
            if w.timing is not None:
                w.timing.queue_s, w.timing.compute_s = started - w.submitted_s, seconds
                w.timing.batch_size = len(batch)
        for w, result in zip(batch, results, strict=True):
            if not w.future.done():
                w.future.set_result(result)
        if here:
            self.stats.rank_batches_on_loop += 1
            await asyncio.sleep(0)      # the batch's waiters answer before the next unit

    def _runs_here(self, batch: list[RankWork]) -> bool:
        if not self.loop_rank_elems or any(w.elems is None for w in batch):
            return False
        return sum(w.elems or 0 for w in batch) <= self.loop_rank_elems

    def _next_prefill(self) -> PrefillWork:
        return min(self._prefills, key=lambda w: (w.waiters == 0, w.seq))

    async def _run_prefill_round(self) -> None:
        work = self._next_prefill()
        self._running_prefill = work

        def one_round() -> tuple[bool, Any]:
            work.step()
            if work.is_done():
                return True, work.finish()
            return False, None

        try:
            (finished, result), seconds = await self.executor.run_timed(one_round)
        except Exception as exc:
            self._running_prefill = None
            self._prefills.remove(work)
            if not work.future.done():
                work.future.set_exception(exc)
            return
        self._running_prefill = None
        work.rounds += 1
        self.stats.prefill_compute_s += seconds
        self.stats.prefill_rounds += 1
        if finished:
            self._prefills.remove(work)
            self.stats.prefill_jobs_done += 1
            if not work.future.done():
                work.future.set_result(result)

    def cancel_prefill(self, work: PrefillWork) -> bool:
        """Drop a queued pre-infer job (its future is cancelled); False if it already ended or
        one of its rounds is running now."""
        if work is not self._running_prefill and any(w is work for w in self._prefills):
            self._prefills.remove(work)
            work.future.cancel()
            return True
        return False

    async def stop(self) -> None:
        """Stop after the unit of compute in flight; fail everything still queued."""
        self._stopped = True
        self._wakeup.set()
        error = InstanceStoppedError(f"{self.executor.name} stopped")
        for w in self._rank_queue:
            if not w.future.done():
                w.future.set_exception(error)
        self._rank_queue.clear()
        for p in self._prefills:
            if not p.future.done():
                p.future.set_exception(error)
        self._prefills.clear()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
