"""Stable 64-bit hashing: the same value in every process, on every machine, in every run.

Python's built-in ``hash()`` is salted per process, so it cannot place a user on an instance
that another process (the other leg of the request, another router replica) must agree on.
Everything here is a pure function of its input: SplitMix64's finaliser for integers
(``relaygr.splitmix``) and BLAKE2b for names.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

from relaygr.splitmix import GOLDEN_GAMMA, mix64


@lru_cache(maxsize=4096)
def name_hash64(name: str) -> int:
    """A 64-bit hash of a name (an instance id), from BLAKE2b; cached because names repeat."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8, person=b"relaygr-name").digest()
    return mix64(int.from_bytes(digest, "little") + GOLDEN_GAMMA)


def pair_weight(user_hash: int, name_hash: int) -> int:
    """The rendezvous weight of a (user, instance) pair: a 64-bit mix of both hashes."""
    return mix64(user_hash ^ name_hash)
