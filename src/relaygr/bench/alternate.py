"""Alternating modes point by point, so machine drift hits every mode alike.

Instead of measuring mode A's whole curve and then mode B's, the benchmark measures point 1 of
every mode, then point 2 of every mode, and so on; the mode that goes first rotates each round,
so no mode is always measured right after another (or always first, on a cold machine).
Adaptive searches advance in the same lock-step: round k measures each unfinished search's k-th
proposal.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TypeVar

from relaygr.bench.search import Outcome, Search

P = TypeVar("P")


def rotated(modes: Sequence[str], round_index: int) -> list[str]:
    """``modes`` starting at position ``round_index`` (mod len), wrapping around."""
    if not modes:
        return []
    k = round_index % len(modes)
    return list(modes[k:]) + list(modes[:k])


def interleave(modes: Sequence[str], points: Sequence[P],
               rotate: bool = True) -> Iterator[tuple[P, str]]:
    """(point, mode) pairs: every mode at point 1, then every mode at point 2, ..."""
    for i, point in enumerate(points):
        for mode in (rotated(modes, i) if rotate else modes):
            yield point, mode


Measure = Callable[[str, P], Awaitable[Outcome]]


async def run_lockstep(searches: Mapping[str, Search[P]], measure: Measure[P],
                       rotate: bool = True, fits: Callable[[P], bool] | None = None) -> int:
    """Advance every search one trial per round until all are done; returns the trial count.

    ``measure(mode, point)`` runs one point and returns its ``Outcome``. ``fits(point)``, when
    given, is asked just before each point is measured: the first point that no longer fits
    the run's time halts every search (``Search.halt``), so that no mode is measured a round
    more than another.
    """
    modes = list(searches)
    trials = 0
    for round_index in range(1_000_000):
        order = rotated(modes, round_index) if rotate else modes
        proposed = False
        for mode in order:
            point = searches[mode].next_point()
            if point is None:
                continue
            proposed = True
            if fits is not None and not fits(point):
                for search in searches.values():
                    search.halt()
                return trials
            searches[mode].record(point, await measure(mode, point))
            trials += 1
        if not proposed:
            return trials
    raise AssertionError("a search never finished")
