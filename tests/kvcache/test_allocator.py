"""RunAllocator: first-fit over coalesced free runs, and eviction planning."""

from __future__ import annotations

from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.kvcache.allocator import PageRun, Placement, RunAllocator


def test_first_fit_takes_the_front_of_the_lowest_run_that_fits() -> None:
    alloc = RunAllocator(10)
    assert [alloc.allocate(n) for n in (3, 2, 4)] == [PageRun(0, 3), PageRun(3, 2), PageRun(5, 4)]
    assert alloc.free_runs() == [PageRun(9, 1)]
    alloc.free(PageRun(3, 2))
    assert alloc.free_runs() == [PageRun(3, 2), PageRun(9, 1)]
    assert alloc.allocate(1) == PageRun(3, 1)              # lowest address that fits
    assert alloc.free_runs() == [PageRun(4, 1), PageRun(9, 1)]
    assert alloc.allocate(2) is None                       # 2 pages free, no run of 2
    assert alloc.free_pages == 2 and alloc.largest_free_run == 1
    alloc.check_integrity([PageRun(0, 3), PageRun(3, 1), PageRun(5, 4)])


def test_free_coalesces_with_both_neighbours() -> None:
    alloc = RunAllocator(9)
    a, b, c = (alloc.allocate(3) for _ in range(3))
    assert alloc.free_runs() == []
    assert a is not None and b is not None and c is not None
    alloc.free(a)
    alloc.free(c)
    assert alloc.free_runs() == [PageRun(0, 3), PageRun(6, 3)]
    alloc.free(b)
    assert alloc.free_runs() == [PageRun(0, 9)]
    alloc.check_integrity([])


def test_double_free_is_an_internal_error() -> None:
    alloc = RunAllocator(4)
    run = alloc.allocate(2)
    assert run is not None
    alloc.free(run)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(run)


def test_integrity_catches_lost_and_double_booked_pages() -> None:
    alloc = RunAllocator(6)
    alloc.allocate(4)
    with pytest.raises(AssertionError, match="lost"):
        alloc.check_integrity([PageRun(0, 3)])
    with pytest.raises(AssertionError, match="double-booked"):
        alloc.check_integrity([PageRun(0, 4), PageRun(3, 1)])
    alloc.check_integrity([PageRun(0, 4)])


def test_plan_uses_freed_runs_then_the_fewest_candidates_in_order() -> None:
    alloc = RunAllocator(10)
    runs = [alloc.allocate(2) for _ in range(5)]           # [0,2) [2,4) [4,6) [6,8) [8,10)
    assert all(r is not None for r in runs)
    a, _, c, d, e = cast(list[PageRun], runs)
    assert alloc.plan(2, [c], [a]) == Placement(PageRun(4, 2), 0)
    # candidates a, d, e: a alone gives 2 pages, d gives [6,8), d+e coalesce to [6,10)
    assert alloc.plan(4, [], [a, d, e]) == Placement(PageRun(6, 4), 3)
    assert alloc.plan(4, [c], [e, d]) == Placement(PageRun(4, 4), 2)
    assert alloc.plan(6, [], [a, c, e]) is None            # 6 pages, never contiguous
    assert alloc.free_runs() == []                         # planning changed nothing


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 6), st.integers(0, 50)),
                    max_size=60))
def test_matches_a_page_bitmap_reference(ops: list[tuple[bool, int, int]]) -> None:
    """Random allocate/free: same answers as brute-force first fit over a bitmap."""
    num_pages = 16
    alloc = RunAllocator(num_pages)
    used = [False] * num_pages
    live: list[PageRun] = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            expected = next((s for s in range(num_pages - size + 1)
                             if not any(used[s:s + size])), None)
            run = alloc.allocate(size)
            assert (run.start if run else None) == expected
            if run is not None:
                used[run.start:run.end] = [True] * size
                live.append(run)
        else:
            run = live.pop(pick % len(live))
            alloc.free(run)
            used[run.start:run.end] = [False] * run.length
        alloc.check_integrity(live)
        assert alloc.free_pages == used.count(False)
