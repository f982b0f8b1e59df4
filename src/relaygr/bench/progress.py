"""Progress display while a benchmark runs (a rich live bar, or nothing).

``Progress`` is the small interface the runner and the suite call; ``RichProgress`` shows one bar
for the points of the whole benchmark and one for the requests of the current point.
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as RichBar


class Progress(Protocol):
    """Callbacks of a running benchmark; implementations must be cheap (called per request)."""

    def start_point(self, label: str, total_requests: int) -> None: ...

    def advance(self, requests: int = 1) -> None: ...

    def end_point(self) -> None: ...

    def note(self, text: str) -> None:
        """A one-line result, kept on screen (and in a log when output is not a terminal)."""
        ...


class NullProgress:
    """Shows nothing (tests, scripted runs)."""

    def start_point(self, label: str, total_requests: int) -> None:
        pass

    def advance(self, requests: int = 1) -> None:
        pass

    def end_point(self) -> None:
        pass

    def note(self, text: str) -> None:
        pass


class RichProgress:
    """Two rich bars: points done (of ``total_points`` when known) and the current point.

    Use as a context manager so the live display is torn down cleanly.
    """

    def __init__(self, total_points: int | None = None, console: Console | None = None) -> None:
        self._bar = RichBar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=False)
        self._points: TaskID = self._bar.add_task("points", total=total_points)
        self._current: TaskID | None = None

    def __enter__(self) -> RichProgress:
        self._bar.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._bar.stop()

    def start_point(self, label: str, total_requests: int) -> None:
        if self._current is not None:
            self._bar.remove_task(self._current)
        self._current = self._bar.add_task(label, total=total_requests)

    def advance(self, requests: int = 1) -> None:
        if self._current is not None:
            self._bar.advance(self._current, requests)

    def end_point(self) -> None:
        self._bar.advance(self._points, 1)

    def note(self, text: str) -> None:
        self._bar.console.print(text, highlight=False)
