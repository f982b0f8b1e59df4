"""Host allocator settings for a serving process: tensor buffers stay mapped between calls.

PyTorch's CPU tensors come from the C allocator. glibc serves a request above its mmap threshold
(128 KiB at start, raised adaptively only as the process frees such blocks) with a fresh
``mmap`` and returns it with ``munmap`` on free, so every model call maps its activations anew
and takes a page fault on each of their pages. Our instances compute on worker threads, whose
malloc arenas see that cost on every ranking pass. Measured on the 2-core CPU box with the cpu
profile's model (512-token prefix, 256 candidates, one worker thread, interleaved runs in one
process): 175,000 page faults per 90 passes with a fixed 128 KiB threshold against 1,500 with a
32 MiB one, and 9.5 -> 6.6 ms per cached ranking pass, 31.5 -> 19.1 ms per full pass.

``tune_host_allocator`` raises the threshold to glibc's maximum (32 MiB on 64-bit, so blocks up
to that size are recycled from the heap) and the trim threshold (the heap top is kept instead of
handed back after each pass). The cost is resident memory: the process keeps its peak working
set. Production CPU serving stacks reach the same end by preloading jemalloc or tcmalloc, as
PyTorch's performance tuning guide recommends; this does it without a preload, and a process
that preloads one of those is unaffected (``mallopt`` then belongs to glibc, which no longer
serves the tensors).

The same settings keep what start-up freed (a server reads a whole dataset to build its users'
histories, then drops the rows): ``release_free_memory`` hands the heap's free pages back to the
kernel once, when start-up is done; the serving passes then fault their working set in once and
keep it.

Invariant: the settings are process-wide and only ever raised; calling twice is harmless.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameter numbers from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# glibc caps the mmap threshold at HEAP_MAX_SIZE / 2: 32 MiB on 64-bit builds.
MAX_MMAP_THRESHOLD_BYTES = 32 << 20


def tune_host_allocator(mmap_threshold_bytes: int = MAX_MMAP_THRESHOLD_BYTES,
                        trim_threshold_bytes: int = 1 << 30) -> bool:
    """Keep tensor-sized blocks in the heap (see the module docstring). Idempotent. False when
    nothing was tuned: not glibc (the platform allocator is left as is), or glibc refused."""
    if not 0 < mmap_threshold_bytes <= MAX_MMAP_THRESHOLD_BYTES or trim_threshold_bytes <= 0:
        raise ValueError(f"thresholds must be in (0, {MAX_MMAP_THRESHOLD_BYTES}] and > 0, got "
                         f"{mmap_threshold_bytes} and {trim_threshold_bytes}")
    libc = _glibc()
    return libc is not None and (libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
                                 and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes) == 1)


def release_free_memory() -> bool:
    """Return the heap's free pages to the kernel (glibc ``malloc_trim(0)``); False when not
    glibc or nothing was returned. Call it once start-up is done, not per request."""
    libc = _glibc()
    return libc is not None and hasattr(libc, "malloc_trim") and libc.malloc_trim(0) == 1


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "mallopt") else None
