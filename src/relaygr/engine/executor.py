"""Where an instance's model compute runs: one worker thread per instance.

The asyncio loop owns all bookkeeping (cache states, queues, routing); tensor work goes to the
instance's single worker thread, so instances compute concurrently (PyTorch releases the GIL
inside ops) while each instance's work stays strictly ordered. On CUDA the worker runs every call
on the instance's own stream and waits for it, so a result handed back to the loop is complete.

``run_here`` runs a call on the caller's thread instead: for short work in a process whose event
loop serves nothing but its instances (``engine.transport.host``), where handing the call to the
worker and the result back (two thread wake-ups, each a sleeping thread woken) costs a visible
share of a short pass, and blocking the loop for the pass delays nothing that would not wait for
the worker anyway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class ComputeExecutor:
    """Runs callables for one instance, one at a time, off the event loop."""

    def __init__(self, name: str, device: torch.device,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock`` (seconds) times each call's compute; the scheduler reads the same clock."""
        self.name = name
        self.device = device
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"relaygr-{name}")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _call(self, fn: Callable[[], T]) -> tuple[T, float]:
        started = self.clock()
        with torch.inference_mode():
            if self._stream is None:
                result = fn()
            else:
                with torch.cuda.stream(self._stream):
                    result = fn()
                self._stream.synchronize()
        return result, self.clock() - started

    def run_here(self, fn: Callable[[], T]) -> tuple[T, float]:
        """``run_timed`` on the calling thread (see the module docstring), blocking it."""
        return self._call(fn)

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
