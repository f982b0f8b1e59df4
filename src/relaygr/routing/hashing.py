"""Stable 64-bit hashing: the same value in every process, on every machine, in every run.

Python's built-in ``hash()`` is salted per process, so it cannot place a user on an instance
that another process (the other leg of the request, another router replica) must agree on.
Everything here is a pure function of its input: SplitMix64's finaliser for integers (scalar
and numpy-vectorised, bit-identical) and BLAKE2b for names.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

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


@lru_cache(maxsize=4096)
def name_hash64(name: str) -> int:
    """A 64-bit hash of a name (an instance id), from BLAKE2b; cached because names repeat."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8, person=b"relaygr-name").digest()
    return mix64(int.from_bytes(digest, "little") + GOLDEN_GAMMA)


def pair_weight(user_hash: int, name_hash: int) -> int:
    """The rendezvous weight of a (user, instance) pair: a 64-bit mix of both hashes."""
    return mix64(user_hash ^ name_hash)
