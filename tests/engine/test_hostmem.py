"""Host allocator tuning: applied on glibc, harmless to repeat, typed refusal of bad thresholds."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from relaygr.engine.hostmem import MAX_MMAP_THRESHOLD_BYTES, tune_host_allocator

PROBE = Path(__file__).with_name("fault_probe.py")
SRC = Path(__file__).resolve().parents[2] / "src"
ON_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not ON_GLIBC, reason="mallopt is glibc's")
def test_tuning_applies_and_repeats() -> None:
    assert tune_host_allocator() is True
    assert tune_host_allocator() is True
    assert tune_host_allocator(MAX_MMAP_THRESHOLD_BYTES, 1 << 30) is True


def _probe_faults(mode: str) -> int:
    # a fresh process each: the settings are process-wide and one-way
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, str(PROBE), mode], check=True, capture_output=True,
                         text=True, env=env, timeout=120)
    return int(out.stdout.strip())


@pytest.mark.skipif(not ON_GLIBC, reason="mallopt is glibc's")
def test_tuned_allocator_stops_faulting_in_each_pass() -> None:
    # Timed ranking passes on a worker thread map their activations afresh each call under
    # glibc's defaults (thousands of page faults for 5 passes); tuned, blocks are recycled.
    default, tuned = _probe_faults("default"), _probe_faults("tuned")
    assert tuned * 3 < default, (tuned, default)


@pytest.mark.parametrize("mmap_bytes, trim_bytes", [(0, 1), (MAX_MMAP_THRESHOLD_BYTES + 1, 1),
                                                    (1 << 20, 0)])
def test_bad_thresholds_are_refused(mmap_bytes: int, trim_bytes: int) -> None:
    with pytest.raises(ValueError, match="thresholds"):
        tune_host_allocator(mmap_bytes, trim_bytes)
