"""Host allocator tuning: applied on glibc, harmless to repeat, typed refusal of bad thresholds."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from relaygr.engine.hostmem import MAX_MMAP_THRESHOLD_BYTES, tune_host_allocator

PROBE = Path(__file__).with_name("alloc_probe.py")
SRC = Path(__file__).resolve().parents[2] / "src"
ON_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
_GLIBC_VERSION = tuple(int(x) for x in (platform.libc_ver()[1] or "0.0").split(".")[:2])


@pytest.mark.skipif(not ON_GLIBC, reason="mallopt is glibc's")
def test_tuning_applies_and_repeats() -> None:
    assert tune_host_allocator() is True
    assert tune_host_allocator() is True
    assert tune_host_allocator(MAX_MMAP_THRESHOLD_BYTES, 1 << 30) is True


def _probe(mode: str) -> str:
    # a fresh process each: the settings are process-wide and one-way
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, str(PROBE), mode], check=True, capture_output=True,
                         text=True, env=env, timeout=120)
    return out.stdout.strip()


def _mapped_blocks(mode: str) -> int:
    return int(_probe(mode))


@pytest.mark.skipif(not ON_GLIBC or _GLIBC_VERSION < (2, 33), reason="mallinfo2: glibc >= 2.33")
def test_tuned_allocator_serves_tensor_sized_blocks_from_the_heap() -> None:
    # The mechanism, from glibc's own counters: a 16 MiB block is mapped afresh under the
    # defaults and taken from the heap once tuned. (What that saves in page faults and time is
    # machine-dependent and measured by `relaygr profile`, not asserted here.)
    assert (_mapped_blocks("default"), _mapped_blocks("tuned")) == (1, 0)


@pytest.mark.parametrize("mmap_bytes, trim_bytes", [(0, 1), (MAX_MMAP_THRESHOLD_BYTES + 1, 1),
                                                    (1 << 20, 0)])
def test_bad_thresholds_are_refused(mmap_bytes: int, trim_bytes: int) -> None:
    with pytest.raises(ValueError, match="thresholds"):
        tune_host_allocator(mmap_bytes, trim_bytes)


@pytest.mark.skipif(not ON_GLIBC, reason="malloc_trim is glibc's")
def test_memory_the_tuned_heap_kept_is_released_once_asked() -> None:
    # 16 MiB written and freed: the tuned heap keeps it resident; the release hands it back
    # (page-granular counts, so within a page or two of the block)
    kept, released = (float(x) for x in _probe("release").split())
    assert kept >= 15.9 and released >= 15.9
