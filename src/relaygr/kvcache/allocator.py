"""Layer 1 of the cache: which pages of an arena are free, as coalesced runs.

Every entry occupies one contiguous run of pages, so the arena can hand the model zero-copy views.
``RunAllocator`` keeps the free pages as maximal runs sorted by start page and allocates
first-fit (lowest address whose run is long enough; the entry takes the front of that run).
Freeing coalesces with both neighbours, so two free runs are never adjacent.

External fragmentation is the price of contiguity: free pages may add up to enough yet no run be
long enough. ``plan`` answers the question the index above asks before evicting anything: "if
these runs were freed, in this order, after how many would a long-enough run exist, and where?"
It is a pure simulation; the allocator changes only in ``allocate``/``free``.

This layer knows pages only: no tensors, entries or users.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from relaygr.kvcache.integrity import require


@dataclass(frozen=True, order=True)
class PageRun:
    """Pages ``start .. start + length - 1`` of an arena."""

    start: int
    length: int

    def __post_init__(self) -> None:
        assert self.start >= 0 and self.length > 0, f"bad run {self.start}+{self.length}"

    @property
    def end(self) -> int:
        """One past the last page."""
        return self.start + self.length

    def overlaps(self, other: PageRun) -> bool:
        return self.start < other.end and other.start < self.end


@dataclass(frozen=True)
class Placement:
    """Outcome of ``RunAllocator.plan``: the run to allocate, and how many of the candidate runs
    (a prefix of the given order) had to be imagined free for it to exist."""

    run: PageRun
    candidates_used: int


class RunAllocator:
    """Free-run bookkeeping over ``num_pages`` pages; starts with everything free."""

    def __init__(self, num_pages: int) -> None:
        assert num_pages > 0, "an allocator needs at least one page"
        self.num_pages = num_pages
        self._starts: list[int] = [0]          # sorted starts of the free runs
        self._length: dict[int, int] = {0: num_pages}
        self._free_pages = num_pages

    # ---- queries ---------------------------------------------------------------------------

    def free_runs(self) -> list[PageRun]:
        """Free runs in address order."""
        return [PageRun(s, self._length[s]) for s in self._starts]

    @property
    def free_pages(self) -> int:
        return self._free_pages

    @property
    def largest_free_run(self) -> int:
        return max(self._length.values(), default=0)

    def first_fit(self, num_pages: int) -> PageRun | None:
        """The run ``allocate(num_pages)`` would return, without allocating."""
        for start in self._starts:
            if self._length[start] >= num_pages:
                return PageRun(start, num_pages)
        return None

    # ---- mutation --------------------------------------------------------------------------

    def allocate(self, num_pages: int) -> PageRun | None:
        """Take ``num_pages`` from the front of the first free run long enough; None if none."""
        assert num_pages > 0, "allocate at least one page"
        run = self.first_fit(num_pages)
        if run is None:
            return None
        self._free_pages -= num_pages
        left = self._length.pop(run.start) - num_pages
        index = bisect.bisect_left(self._starts, run.start)
        if left:
            self._starts[index] = run.end
            self._length[run.end] = left
        else:
            del self._starts[index]
        return run

    def free(self, run: PageRun) -> None:
        """Return ``run`` (which must be allocated) and coalesce it with free neighbours."""
        assert run.end <= self.num_pages, f"run {run} outside {self.num_pages} pages"
        index = bisect.bisect_left(self._starts, run.start)
        nxt = self._starts[index] if index < len(self._starts) else None
        prev = self._starts[index - 1] if index > 0 else None
        prev_end = None if prev is None else prev + self._length[prev]
        assert nxt is None or nxt >= run.end, f"double free: {run} overlaps free run at {nxt}"
        assert prev_end is None or prev_end <= run.start, f"double free: {run} overlaps {prev}"
        self._free_pages += run.length
        start, length = run.start, run.length
        if nxt == run.end:                       # merge with the run after
            length += self._length.pop(nxt)
            del self._starts[index]
        if prev is not None and prev_end == run.start:   # merge into the run before
            self._length[prev] += length
            return
        self._starts.insert(index, start)
        self._length[start] = length

    # ---- planning --------------------------------------------------------------------------

    def plan(self, num_pages: int, freed: Sequence[PageRun],
             candidates: Iterable[PageRun]) -> Placement | None:
        """Where ``num_pages`` would go if ``freed`` were free, then if also the first k
        ``candidates`` were (k as small as possible); None if even all of them are not enough.

        With ``freed`` alone the answer is first-fit. Otherwise the run is placed at the start
        of the coalesced free run that the k-th candidate completes: before that candidate no
        run was long enough, so every long-enough run contains it, and the chosen pages always
        include some of the k-th candidate's pages.
        """
        sim = _FreeSpace(self.free_runs())
        for run in freed:
            sim.add(run)
        fit = sim.first_fit(num_pages)
        if fit is not None:
            return Placement(PageRun(fit, num_pages), 0)
        for used, run in enumerate(candidates, start=1):
            start, length = sim.add(run)
            if length >= num_pages:
                return Placement(PageRun(start, num_pages), used)
        return None

    # ---- integrity -------------------------------------------------------------------------

    def check_integrity(self, allocated: Iterable[PageRun]) -> None:
        """Free runs and ``allocated`` partition the pages exactly; free runs are coalesced."""
        runs = self.free_runs()
        require(self._starts == sorted(self._length), "free-run index out of sync")
        require(self._free_pages == sum(self._length.values()), "free-page count drifted")
        for a, b in itertools.pairwise(runs):
            require(a.end < b.start, f"free runs {a} and {b} overlap or are not coalesced")
        owned = sorted(list(allocated) + runs)
        cursor = 0
        for run in owned:
            problem = "lost" if run.start > cursor else "double-booked"
            require(run.start == cursor, f"page {cursor} is {problem} (next run {run})")
            cursor = run.end
        require(cursor == self.num_pages, f"pages {cursor}..{self.num_pages} unaccounted for")


class _FreeSpace:
    """Coalescing free-run set used for planning (dicts by start and by end: O(1) per add)."""

    def __init__(self, runs: Iterable[PageRun]) -> None:
        self.by_start: dict[int, int] = {}   # start -> end
        self.by_end: dict[int, int] = {}     # end -> start
        for run in runs:
            self.add(run)

    def add(self, run: PageRun) -> tuple[int, int]:
        """Add ``run`` (disjoint from the set) and return the coalesced ``(start, length)``."""
        start, end = run.start, run.end
        if start in self.by_end:                 # a run ends where this one starts
            start = self.by_end.pop(start)
            del self.by_start[start]
        if end in self.by_start:                 # a run starts where this one ends
            end = self.by_start.pop(end)
            del self.by_end[end]
        self.by_start[start] = end
        self.by_end[end] = start
        return start, end - start

    def first_fit(self, num_pages: int) -> int | None:
        fits = [s for s, e in self.by_start.items() if e - s >= num_pages]
        return min(fits, default=None)
