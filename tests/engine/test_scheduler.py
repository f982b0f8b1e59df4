"""The instance scheduler runs ranking first, pre-infer in chunk rounds, and fails cleanly."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
import torch

from relaygr.engine.executor import ComputeExecutor
from relaygr.engine.scheduler import (
    BatchPolicy,
    BusyMeter,
    InstanceScheduler,
    InstanceStoppedError,
    RankWork,
)


class Trace:
    """A fake model: records what ran, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def run_batch(self, payloads: list[str]) -> list[str]:
        self.events.append("rank:" + ",".join(payloads))
        return [p.upper() for p in payloads]

    def prefill(self, name: str, rounds: int) -> tuple:
        state = {"left": rounds}

        def step() -> None:
            state["left"] -= 1
            self.events.append(f"{name}:{rounds - state['left']}")

        return step, lambda: state["left"] == 0, lambda: f"{name}-done"


class FakeClock:
    """Seconds that pass only when a fake computation says so (``advance``), on any thread."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make(trace: Trace, clock: FakeClock | None = None, **policy: int) -> InstanceScheduler:
    executor = ComputeExecutor("test", torch.device("cpu"), clock=clock or FakeClock())
    return InstanceScheduler(executor, trace.run_batch, BatchPolicy(**policy) if policy else None)


def test_ranking_goes_before_queued_prefill_rounds() -> None:
    async def scenario() -> list[str]:
        trace = Trace()
        sched = make(trace, max_requests=1)
        job = sched.submit_prefill(*trace.prefill("p", 3))
        r1 = sched.submit_rank("a", 1)
        r2 = sched.submit_rank("b", 1)
        sched.start()
        assert await r1 == "A" and await r2 == "B"
        assert await job.future == "p-done"
        await sched.stop()
        return trace.events

    assert asyncio.run(scenario()) == ["rank:a", "rank:b", "p:1", "p:2", "p:3"]


def test_a_prefill_that_ranking_waits_on_alternates_with_ranking_batches() -> None:
    async def scenario() -> list[str]:
        trace = Trace()
        sched = make(trace, max_requests=1)
        job = sched.submit_prefill(*trace.prefill("p", 3))
        job.waiters = 1                  # a ranking request awaits this prefix
        ranks = [sched.submit_rank(x, 1) for x in "abcd"]
        sched.start()
        assert [await r for r in ranks] == ["A", "B", "C", "D"]
        assert await job.future == "p-done"
        await sched.stop()
        return trace.events

    assert asyncio.run(scenario()) == ["rank:a", "p:1", "rank:b", "p:2", "rank:c", "p:3",
                                       "rank:d"]


def test_ranking_arriving_mid_prefill_waits_at_most_one_round() -> None:
    async def scenario() -> list[str]:
        trace = Trace()
        sched = make(trace)
        step, done, finish = trace.prefill("p", 4)
        late: list[asyncio.Future[str]] = []

        def step_then_submit() -> None:
            step()
            if len(trace.events) == 1:   # a ranking request arrives during round 1
                loop.call_soon_threadsafe(lambda: late.append(sched.submit_rank("x", 1)))

        loop = asyncio.get_running_loop()
        job = sched.submit_prefill(step_then_submit, done, finish)
        sched.start()
        await job.future
        assert await late[0] == "X"
        await sched.stop()
        return trace.events

    assert asyncio.run(scenario()) == ["p:1", "rank:x", "p:2", "p:3", "p:4"]


def test_prefill_with_waiting_ranking_request_is_boosted() -> None:
    async def scenario() -> list[str]:
        trace = Trace()
        sched = make(trace)
        first = sched.submit_prefill(*trace.prefill("old", 2))
        second = sched.submit_prefill(*trace.prefill("hot", 2))
        second.waiters += 1
        sched.start()
        await asyncio.gather(first.future, second.future)
        await sched.stop()
        return trace.events

    assert asyncio.run(scenario()) == ["hot:1", "hot:2", "old:1", "old:2"]


def test_batch_policy_merges_queued_requests_up_to_limits() -> None:
    loop = asyncio.new_event_loop()
    try:
        queue = deque(RankWork(str(i), cost, loop.create_future())
                      for i, cost in enumerate([10, 10, 10, 50, 10]))
        policy = BatchPolicy(max_requests=4, max_tokens=40)
        assert [w.payload for w in policy.take(queue)] == ["0", "1", "2"]   # 80 > 40 stops
        assert [w.payload for w in policy.take(queue)] == ["3"]             # alone even if big
        assert [w.payload for w in policy.take(queue)] == ["4"]
    finally:
        loop.close()


def test_failed_batch_fails_only_its_requests() -> None:
    async def scenario() -> None:
        calls: list[list[str]] = []

        def run_batch(payloads: list[str]) -> list[str]:
            calls.append(payloads)
            if "bad" in payloads:
                raise RuntimeError("kernel failed")
            return payloads

        sched = InstanceScheduler(ComputeExecutor("t", torch.device("cpu")), run_batch,
                                  BatchPolicy(max_requests=1))
        bad, good = sched.submit_rank("bad", 1), sched.submit_rank("good", 1)
        sched.start()
        with pytest.raises(RuntimeError, match="kernel failed"):
            await bad
        assert await good == "good"
        await sched.stop()

    asyncio.run(scenario())


def _merging(run_batch: Callable[[list[str]], list[str]], payloads: tuple[str, ...]
             ) -> tuple[InstanceScheduler, list[asyncio.Future[Any]]]:
    """A started scheduler over ``run_batch`` (up to 4 requests a batch) with ``payloads``
    queued before it starts, so that they merge into one batch."""
    sched = InstanceScheduler(ComputeExecutor("t", torch.device("cpu")), run_batch,
                              BatchPolicy(max_requests=4))
    futures = [sched.submit_rank(p, 1) for p in payloads]
    sched.start()
    return sched, futures


def test_a_failed_batch_runs_again_one_request_at_a_time_and_fails_only_the_bad_one() -> None:
    async def scenario() -> None:
        calls: list[list[str]] = []

        def run_batch(payloads: list[str]) -> list[str]:
            calls.append(payloads)
            if "bad" in payloads:
                raise ValueError("the model refuses this request")
            return [p.upper() for p in payloads]

        sched, futures = _merging(run_batch, ("a", "bad", "b"))
        done = await asyncio.gather(*futures, return_exceptions=True)
        assert done[0] == "A" and done[2] == "B"
        assert isinstance(done[1], ValueError)
        # merged first, then each alone: the other requests are answered by their own passes
        assert calls == [["a", "bad", "b"], ["a"], ["bad"], ["b"]]
        stats = sched.stats
        assert (stats.rank_batches_split, stats.rank_requests_failed) == (1, 1)
        assert (stats.rank_batches, stats.rank_requests) == (2, 2)   # the passes that answered
        assert stats.batch_sizes == {1: 2}
        await sched.stop()

    asyncio.run(scenario())


def test_a_stop_during_a_failed_batchs_retries_fails_the_rest_over() -> None:
    """The instance stops while its failed batch waits to be run again request by request: the
    requests not yet run get InstanceStoppedError (the fleet answers them elsewhere), as queued
    work does, instead of keeping the stopping instance computing."""
    async def scenario() -> None:
        calls: list[list[str]] = []
        loop = asyncio.get_running_loop()

        def run_batch(payloads: list[str]) -> list[str]:
            calls.append(list(payloads))
            if len(payloads) > 1:          # the instance is stopped as its batch fails
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(sched.stop()))
                raise ValueError("the model refuses one of them")
            return [p.upper() for p in payloads]

        sched, futures = _merging(run_batch, ("a", "b", "c"))
        done = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(d, InstanceStoppedError) for d in done), done
        assert calls == [["a", "b", "c"]]

    asyncio.run(scenario())


def test_a_batch_returning_too_few_results_fails_its_requests_and_the_loop_goes_on() -> None:
    async def scenario() -> None:
        def run_batch(payloads: list[str]) -> list[str]:
            return [] if payloads == ["short"] else payloads

        sched = InstanceScheduler(ComputeExecutor("t", torch.device("cpu")), run_batch,
                                  BatchPolicy(max_requests=1))
        short, fine = sched.submit_rank("short", 1), sched.submit_rank("fine", 1)
        sched.start()
        with pytest.raises(RuntimeError, match="0 results for 1 requests"):
            await short
        assert await fine == "fine"              # the scheduler's loop survived it
        await sched.stop()

    asyncio.run(scenario())


def test_stop_fails_queued_work_and_rejects_new_work() -> None:
    async def scenario() -> None:
        trace = Trace()
        sched = make(trace)
        queued = sched.submit_rank("a", 1)
        job = sched.submit_prefill(*trace.prefill("p", 2))
        await sched.stop()       # never started: nothing ran
        with pytest.raises(InstanceStoppedError):
            await queued
        with pytest.raises(InstanceStoppedError):
            await job.future
        with pytest.raises(InstanceStoppedError):
            await sched.submit_rank("b", 1)
        assert trace.events == []

    asyncio.run(scenario())


def test_worker_compute_time_is_accounted_per_kind() -> None:
    # Compute time on a fake clock: a ranking batch "computes" 20 ms, each pre-infer round 1 ms.
    clock = FakeClock()

    class Slow(Trace):
        def run_batch(self, payloads: list[str]) -> list[str]:
            clock.advance(0.02)
            return super().run_batch(payloads)

    async def scenario() -> InstanceScheduler:
        trace = Slow()
        sched = make(trace, clock, max_requests=1)
        step, done, finish = trace.prefill("p", 2)

        def timed_step() -> None:
            clock.advance(0.001)
            step()

        job = sched.submit_prefill(timed_step, done, finish)
        sched.start()
        assert await sched.submit_rank("a", 1) == "A" and await job.future == "p-done"
        await sched.stop()
        return sched

    stats = asyncio.run(scenario()).stats
    assert (stats.rank_batches, stats.prefill_rounds) == (1, 2)
    assert stats.rank_compute_s == pytest.approx(0.02, abs=1e-12)
    assert stats.prefill_compute_s == pytest.approx(0.002, abs=1e-12)
    # worker time only, and all of it: the calls ran one after another on the one clock
    assert stats.rank_compute_s + stats.prefill_compute_s == pytest.approx(clock.now_s)


def test_busy_meter_counts_recent_and_running_compute() -> None:
    now = [0.0]
    meter = BusyMeter(window_s=2.0, clock=lambda: now[0])
    assert meter.fraction() == 0.0
    meter.start()
    now[0] = 0.5
    assert meter.fraction() == pytest.approx(0.25)     # the call in flight counts
    meter.end()
    assert meter.fraction() == pytest.approx(0.25)     # ... and once ended, the same 0.5 s
    now[0] = 1.5
    meter.start()
    meter.end()                                        # a zero-length call adds nothing
    assert meter.fraction() == pytest.approx(0.25)
    now[0] = 2.25                                      # the window now starts at 0.25
    assert meter.fraction() == pytest.approx(0.125)
    now[0] = 3.0                                       # the old call has left the window
    assert meter.fraction() == 0.0
    with pytest.raises(ValueError, match="window_s"):
        BusyMeter(window_s=0.0)


def test_rank_busy_counts_ranking_batches_only() -> None:
    # The trigger's load signal: 30 ms of ranking is counted, 60 ms of pre-infer rounds is not
    # (time on a fake clock that only the fake computations move).
    clock = FakeClock()

    class Slow(Trace):
        def run_batch(self, payloads: list[str]) -> list[str]:
            clock.advance(0.03)
            return super().run_batch(payloads)

    async def scenario() -> tuple[float, float]:
        trace = Slow()
        sched = make(trace, clock)
        sched.start()
        step, done, finish = trace.prefill("p", 2)

        def slow_step() -> None:
            clock.advance(0.03)
            step()

        await sched.submit_prefill(slow_step, done, finish).future
        idle_after_prefill = sched.rank_busy.fraction()
        await sched.submit_rank("a", 1)
        busy = sched.rank_busy.fraction() * sched.rank_busy.window_s
        await sched.stop()
        return idle_after_prefill, busy

    idle, busy_s = asyncio.run(scenario())
    assert idle == 0.0
    assert busy_s == pytest.approx(0.03, abs=1e-12)


def test_short_known_batches_run_on_the_loop_thread_and_the_rest_on_the_worker() -> None:
    # With a bound of 100 scores, batches of known size within it compute on the loop's own
    # thread; one over it, one of unknown size (a full pass) and every pre-infer round go to
    # the worker. Order, results and accounting are those of the worker path.
    async def scenario() -> tuple[list[tuple[str, bool]], InstanceScheduler]:
        loop_thread = threading.get_ident()
        ran: list[tuple[str, bool]] = []

        def run_batch(payloads: list[str]) -> list[str]:
            ran.append((",".join(payloads), threading.get_ident() == loop_thread))
            return [p.upper() for p in payloads]

        def step() -> None:
            ran.append(("prefill", threading.get_ident() == loop_thread))

        sched = InstanceScheduler(ComputeExecutor("t", torch.device("cpu")), run_batch,
                                  BatchPolicy(max_requests=2), loop_rank_elems=100)
        ranks = [sched.submit_rank("a", 1, elems=40), sched.submit_rank("b", 1, elems=60),
                 sched.submit_rank("c", 1, elems=60), sched.submit_rank("d", 1, elems=50),
                 sched.submit_rank("e", 1, elems=None)]
        job = sched.submit_prefill(step, lambda: True, lambda: "p-done")
        sched.start()
        assert [await r for r in ranks] == ["A", "B", "C", "D", "E"]
        assert await job.future == "p-done"
        await sched.stop()
        return ran, sched

    ran, sched = asyncio.run(scenario())
    assert ran == [("a,b", True), ("c,d", False), ("e", False), ("prefill", False)]
    assert sched.stats.rank_batches == 3 and sched.stats.rank_batches_on_loop == 1
    assert sched.stats.rank_requests == 5


def test_no_batch_runs_on_the_loop_thread_without_a_bound() -> None:
    async def scenario() -> bool:
        loop_thread = threading.get_ident()
        where: list[bool] = []

        def run_batch(payloads: list[str]) -> list[str]:
            where.append(threading.get_ident() == loop_thread)
            return payloads

        sched = InstanceScheduler(ComputeExecutor("t", torch.device("cpu")), run_batch)
        ranked = sched.submit_rank("a", 1, elems=1)
        sched.start()
        assert await ranked == "a"
        await sched.stop()
        return any(where)

    assert asyncio.run(scenario()) is False
