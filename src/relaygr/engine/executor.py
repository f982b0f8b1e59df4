"""Where an instance's model compute runs: one worker thread per instance.

The asyncio loop owns all bookkeeping (cache states, queues, routing); tensor work goes to the
instance's single worker thread, so instances compute concurrently (PyTorch releases the GIL
inside ops) while each instance's work stays strictly ordered. On CUDA the worker runs every call
on the instance's own stream and waits for it, so a result handed back to the loop is complete.
``BusyMeter`` measures the share of recent time some kind of work ran (the scheduler keeps one
for ranking: the trigger's load signal).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class BusyMeter:
    """The share of the last ``window_s`` seconds spent in one kind of work, counting the call
    in flight. Calls are recorded as ``(start, end)`` on the clock; the caller runs them one at a
    time (the instance's scheduler does), so intervals never overlap and the fraction is in
    [0, 1]. Not thread-safe: one event loop records and reads.
    """

    def __init__(self, window_s: float = 2.0, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s, self.clock = window_s, clock
        self._done: deque[tuple[float, float]] = deque()
        self._running_since: float | None = None

    def start(self) -> float:
        now = self.clock()
        self._running_since = now
        return now

    def end(self, started: float) -> float:
        now = self.clock()
        self._done.append((started, now))
        self._running_since = None
        return now - started

    def fraction(self) -> float:
        now = self.clock()
        horizon = now - self.window_s
        while self._done and self._done[0][1] <= horizon:
            self._done.popleft()
        busy = sum(end - max(start, horizon) for start, end in list(self._done))
        running = self._running_since
        if running is not None:
            busy += now - max(running, horizon)
        return min(1.0, max(0.0, busy / self.window_s))


class ComputeExecutor:
    """Runs callables for one instance, one at a time, off the event loop."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"relaygr-{name}")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _call(self, fn: Callable[[], T]) -> tuple[T, float]:
        started = time.perf_counter()
        with torch.inference_mode():
            if self._stream is None:
                result = fn()
            else:
                with torch.cuda.stream(self._stream):
                    result = fn()
                self._stream.synchronize()
        return result, time.perf_counter() - started

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker; exceptions propagate to the awaiting caller."""
        result, _ = await self.run_timed(fn)
        return result

    async def run_timed(self, fn: Callable[[], T]) -> tuple[T, float]:
        """``run``, also returning the seconds ``fn`` computed (the worker's time, no queueing)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._call, fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
