"""``relaygr.wake.sleep_until``: never before the moment, at once when it has passed, in
order for many waiters, and a cancelled waiter leaves the others be. (How close to the moment it
wakes is a matter of the machine, measured where the benchmark runs, not asserted here.)"""

from __future__ import annotations

import asyncio
import time

from relaygr.wake import COARSE_S, _Waker, sleep_until
from tests.virtual_time import run_virtual


def test_a_waiter_returns_at_or_after_its_moment_on_either_timer() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        late = []
        for ahead in (0.0005, COARSE_S / 2, 3 * COARSE_S):   # the thread alone, then both
            deadline = loop.time() + ahead
            await sleep_until(deadline)
            late.append(loop.time() - deadline)
        return late

    assert all(s >= 0 for s in asyncio.run(main()))


def test_a_past_moment_returns_after_yielding_once() -> None:
    async def main() -> list[str]:
        order: list[str] = []

        async def other() -> None:
            order.append("other")

        task = asyncio.ensure_future(other())
        await sleep_until(asyncio.get_running_loop().time() - 1.0)
        order.append("waiter")
        await task
        return order

    assert asyncio.run(main()) == ["other", "waiter"]


def test_the_thread_wakes_waiters_earliest_first_and_skips_a_cancelled_one() -> None:
    """Eight waiters registered at once (the waker's lock held, so none is woken before all
    are in), their moments in reverse order: woken earliest moment first."""
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        waker = _Waker()
        woke: list[int] = []
        futures = [loop.create_future() for _ in range(8)]
        def record(future: asyncio.Future[None]) -> None:
            woke.append(futures.index(future))

        for future in futures:
            future.add_done_callback(record)
        now = time.monotonic()
        with waker._ready:
            for i, future in enumerate(futures):
                waker.wake_at(now - 0.001 * i, loop, future)   # all due: the latest first
            futures[3].cancel()
        await asyncio.gather(*(f for i, f in enumerate(futures) if i != 3))
        return woke

    # the cancelled one's callback ran at its cancel, before the others were woken
    assert asyncio.run(main()) == [3, 7, 6, 5, 4, 2, 1, 0]


def test_waiters_on_two_loops_in_turn_are_both_woken() -> None:
    """The thread outlives a loop: a later loop's waiters are woken too."""
    for _ in range(2):
        asyncio.run(sleep_until_soon())


async def sleep_until_soon() -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 0.001
    await sleep_until(deadline)
    assert loop.time() >= deadline


def test_a_loop_on_a_clock_of_its_own_waits_on_its_own_timer() -> None:
    """On virtual time the moment is reached by the loop's clock alone, at once in real time."""
    async def main() -> float:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3600.0
        await sleep_until(deadline)
        return loop.time() - deadline

    assert run_virtual(main()) == 0.0
