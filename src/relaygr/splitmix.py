"""SplitMix64's finaliser: the one fixed 64-bit integer mix of the project, scalar and
numpy-vectorised (bit-identical).

A pure function of its input, the same in every process, on every machine, in every run:
routing places users with it (``routing.hashing``), the engine versions a run of events with it
(``engine.versions``), and the data layer fingerprints an interaction table with it
(``data.fingerprint``). It sits at the bottom of the layers (beside ``errors``) so that any
package may use the one mix, whatever its layer.
"""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
# SplitMix64 constants (Steele, Lea & Flood, "Fast splittable pseudorandom number generators").
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def mix64(value: int) -> int:
    """SplitMix64 finaliser of ``value`` modulo 2**64: a bijection with full avalanche."""
    z = value & MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & MASK64
    return z ^ (z >> 31)


def mix64_array(values: np.ndarray) -> np.ndarray:
    """``mix64`` element-wise over a uint64 array (wrapping arithmetic, same bits as the scalar)."""
    z = np.asarray(values, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(_MUL1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_MUL2)
        z ^= z >> np.uint64(31)
    return z
