"""Layer 3 (tiering) helper: host<->device copies that overlap compute.

On CUDA, copies are issued on a dedicated side stream, ordered after everything already queued
on the compute stream (a freed page may still be read by a queued ranking kernel), with
``non_blocking`` so page-locked host memory moves by DMA while the compute stream keeps running.
``finished()`` records an event on the side stream and waits for it in a worker thread, so the
event loop keeps serving while the copy runs; once it returns, any stream may read the data.
On CPU, ``copy`` runs the copies on the transfer's own thread (a memcpy of a long prefix takes
milliseconds, which the event loop should not spend), and ``finished()`` returns at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch


class Transfer:
    """Side-stream copies for one device (see the module docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._thread: ThreadPoolExecutor | None = None

    async def copy(self, fn: Callable[[bool], None]) -> None:
        """Run ``fn(non_blocking)`` (the copies) off the event loop and wait until they are done:
        on the side stream on CUDA, on the transfer's thread on CPU."""
        if self.stream is not None:
            with self.side() as non_blocking:
                fn(non_blocking)
            await self.finished()
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relaygr-copy")
        await asyncio.get_running_loop().run_in_executor(self._thread, fn, False)

    def close(self) -> None:
        """Stop the CPU copy thread (a later ``copy`` starts a new one)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    @property
    def asynchronous(self) -> bool:
        return self.stream is not None

    @contextmanager
    def side(self) -> Iterator[bool]:
        """Run the enclosed copies on the side stream; yields the ``non_blocking`` flag."""
        if self.stream is None:
            yield False
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield True

    async def finished(self) -> None:
        """Wait (without blocking the event loop) for the copies issued so far."""
        if self.stream is None:
            return
        event = torch.cuda.Event()
        event.record(self.stream)
        await asyncio.get_running_loop().run_in_executor(None, event.synchronize)
