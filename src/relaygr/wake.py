"""Waking a coroutine at a moment to within about a tenth of a millisecond, not asyncio's one.

asyncio's selector rounds every timeout up to whole milliseconds (``epoll_wait`` counts in
ms), so an ``asyncio.sleep`` ends up to a millisecond late, plus the wake-up. Where the moment
is part of what is measured, that error is not the system's: the benchmark's dispatcher sends
each request at its scheduled moment, and the cascade's simulated earlier stages end at their
configured delay (a real stage ends with a socket event, which wakes the loop at once). Both
were charged about 1 ms each on every request (the hand-over part of the ranking latency,
``relaygr.bench.protocol.LatencyParts.handoff_s``).

``sleep_until`` sleeps on asyncio's own timer to within ``COARSE_S`` of the moment, then hands
the rest to one daemon thread that waits on a condition (its timeouts are not rounded to ms)
and wakes the loop through ``call_soon_threadsafe`` (the loop's self-pipe: an event, no
timeout to round). The thread spends no CPU while it waits and none of the loop's time. To run
the wake-up it needs the GIL: an idle loop, waiting in its selector, holds none, and a busy one
lets go at its next turn, when its own timers would fire too.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import threading
import time

# asyncio's timer takes a wait up to this long before the moment: its rounding (< 1 ms) and
# its wake-up end inside it, so the thread always has the last stretch
COARSE_S = 0.002
# The thread's clock is ``time.monotonic``, asyncio's default loop's too; a loop whose clock is
# further from it than this (a test's virtual time, say) waits on its own timer throughout
OTHER_CLOCK_S = 0.01


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():          # its waiter may have been cancelled meanwhile
        future.set_result(None)


class _Waker:
    """The thread behind ``sleep_until``: wakes each waiting future's loop at its moment
    (``time.monotonic``), earliest first; started on first use (and again in a forked child,
    where the parent's thread does not run)."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._due: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._order = itertools.count()     # ties wake in the order they were asked for
        self._thread: threading.Thread | None = None

    def wake_at(self, at: float, loop: asyncio.AbstractEventLoop,
                future: asyncio.Future[None]) -> None:
        with self._ready:
            heapq.heappush(self._due, (at, next(self._order), loop, future))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="relaygr-wake",
                                                daemon=True)
                self._thread.start()
            self._ready.notify()

    def _next(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]:
        """The earliest waiter, once its moment has come."""
        with self._ready:
            while True:
                if not self._due:
                    self._ready.wait()
                    continue
                left = self._due[0][0] - time.monotonic()
                if left <= 0:
                    _, _, loop, future = heapq.heappop(self._due)
                    return loop, future
                self._ready.wait(left)

    def _run(self) -> None:
        while True:
            loop, future = self._next()
            # its loop may have closed meanwhile (RuntimeError): then no one waits any more
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)


_WAKER = _Waker()


async def sleep_until(deadline: float) -> None:
    """Return at ``deadline`` on the running loop's clock (``loop.time()``), to within about a
    tenth of a millisecond on an idle loop (module docstring); at once, after yielding to the
    loop once, when it has passed. A loop whose clock is not ``time.monotonic`` (``OTHER_CLOCK_S``)
    sleeps on its own timer."""
    loop = asyncio.get_running_loop()
    left = deadline - loop.time()
    if abs(loop.time() - time.monotonic()) > OTHER_CLOCK_S:
        await asyncio.sleep(max(0.0, left))     # a loop on a clock of its own: its own timer
        return
    if left > COARSE_S:
        await asyncio.sleep(left - COARSE_S)
        left = deadline - loop.time()
    if left <= 0:
        await asyncio.sleep(0)
        return
    future: asyncio.Future[None] = loop.create_future()
    _WAKER.wake_at(time.monotonic() + left, loop, future)
    await future
