"""Run by test_hostmem in a fresh process (the allocator settings are process-wide and one-way).

Allocates and frees one 16 MiB block with the C allocator and prints how many blocks glibc served
with a fresh ``mmap`` for it (``mallinfo2().hblks`` before and after): 1 under glibc's default
128 KiB mmap threshold, 0 once ``tune_host_allocator`` keeps blocks of that size in the heap.
That is the mechanism itself, read from glibc's own counters; how much time it saves on a given
machine is a figure for ``relaygr profile``, not a test. ``python alloc_probe.py tuned|default``.

``python alloc_probe.py release``: tuned, a 16 MiB block written and freed; prints the MiB of
resident memory the heap kept after the free, then what ``release_free_memory`` handed back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

BLOCK_BYTES = 16 << 20  # above the default threshold, below the tuned one (32 MiB)


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def mapped_blocks_for_one_allocation(tuned: bool) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if tuned:
        # imported only here: importing torch could free a large mapped block, and glibc would
        # then raise the default's threshold on its own (its dynamic threshold)
        from relaygr.engine.hostmem import tune_host_allocator

        assert tune_host_allocator()
    before = libc.mallinfo2().hblks
    block = libc.malloc(BLOCK_BYTES)
    during = libc.mallinfo2().hblks
    libc.free(block)
    return int(during - before)


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * ctypes.CDLL(None).getpagesize() / (1 << 20)


def kept_and_released_mib() -> tuple[float, float]:
    from relaygr.engine.hostmem import release_free_memory, tune_host_allocator

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    assert tune_host_allocator()
    before = resident_mib()
    block = libc.malloc(BLOCK_BYTES)
    ctypes.memset(block, 1, BLOCK_BYTES)        # resident now
    libc.free(block)
    kept = resident_mib() - before
    assert release_free_memory()
    return kept, kept + before - resident_mib()


if __name__ == "__main__":
    if sys.argv[1] == "release":
        print(*kept_and_released_mib())
    else:
        print(mapped_blocks_for_one_allocation(sys.argv[1] == "tuned"))
