"""relaygr's processes keep OpenMP's spin short unless the user said otherwise."""

from __future__ import annotations

import os
import subprocess
import sys


def _spin_in_a_fresh_process(**env: str) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import relaygr, os; print(os.environ.get('GOMP_SPINCOUNT'))"
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env},
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_importing_relaygr_bounds_openmp_spinning() -> None:
    assert _spin_in_a_fresh_process() == "1000"


def test_a_spin_count_or_wait_policy_the_user_set_is_kept() -> None:
    assert _spin_in_a_fresh_process(GOMP_SPINCOUNT="50000") == "50000"
    assert _spin_in_a_fresh_process(OMP_WAIT_POLICY="ACTIVE") == "None"
