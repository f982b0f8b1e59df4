"""An asyncio event loop on virtual time, for tests of timing logic that no machine can upset.

The loop's clock stands still while callbacks run and jumps straight to the next timer whenever
the loop would otherwise wait for it, so ``asyncio.sleep(0.3)`` returns at once with the clock
0.3 s later. A fake that blocks the loop calls ``advance`` (a blocking call, as the loop sees
it: time passes and nothing else runs). Waiting on real I/O or another thread still waits, with
the clock stopped, so use it only for code whose time comes from timers. Every latency the code
under test computes is then an exact function of its inputs, on a fast, slow or busy machine.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls instead of sleeping; a wait for a timer moves the owning loop's clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now_s = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is not None and timeout > 0:
            self.now_s += timeout
            timeout = 0
        return super().select(timeout)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now_s

    def advance(self, seconds: float) -> None:
        """Move the clock as a blocking call of ``seconds`` would (nothing else runs)."""
        assert seconds >= 0
        self._jumping.now_s += seconds


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh ``VirtualTimeLoop``."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
