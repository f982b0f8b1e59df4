"""Default cache budgets from the model and its users, never from one-size constants.

A tier's arena is preallocated (and touched, so serving never faults it in), so its budget is
memory the process holds from start-up: bytes of K/V per token (the model's layout) times the
tokens expected to be resident. The device tier holds the prefixes an instance has leased or is
computing: a few hundred users at a time. The host tier holds what was demoted after ranking,
for a revisit within minutes: a multiple of that. A resident prefix is one user's history as the
model reads it (at most ``max_seq_len`` events), so a tier of N prefixes expects N times the
users' mean of that length (the lengths of N users drawn at random sum to about N means when N
is in the hundreds; a mix of longer ones only means more misses, never a wrong score). Both are
capped so that all instances' caches together take at most a fraction of the memory available
at start-up (GPU memory for a CUDA device tier), and the device tier never goes below two
longest prefixes, so any request fits. An explicit budget always wins (``device_budget_bytes``,
``host_budget_bytes`` in a system config); the sizing is what a server uses when none was given,
and it prints how it sized them at start-up.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relaygr.kvcache.pools import KVLayout

# Prefixes leased or in flight on one instance at once: an instance serves tens of requests per
# second, each holding its prefix for a lease of a few seconds at most.
DEVICE_RESIDENT_USERS = 256
# Host tier : device tier. Demoted prefixes wait there for a revisit (refresh, pagination).
HOST_TO_DEVICE = 4
# Of the memory available at start-up, the most all instances' caches may take together.
MEMORY_FRACTION = 0.25


@dataclass(frozen=True)
class CacheBudgets:
    """Budgets of one instance's two tiers, and the figures they came from."""

    device_bytes: int
    host_bytes: int
    mean_tokens: float       # a resident prefix's expected length: the users' mean
    token_bytes: int         # arena bytes per cached token
    capped: bool             # scaled down to fit MEMORY_FRACTION of available memory

    def describe(self) -> str:
        mib = 1 << 20
        how = f"{DEVICE_RESIDENT_USERS} prefixes of {self.mean_tokens:.0f} tokens (the users' " \
              f"mean) x {self.token_bytes} B on the device, {HOST_TO_DEVICE}x that on the host"
        if self.capped:
            how += f", scaled to {MEMORY_FRACTION:.0%} of available memory"
        return (f"cache per instance: device {self.device_bytes / mib:.0f} MiB, host "
                f"{self.host_bytes / mib:.0f} MiB ({how})")


def size_budgets(layout: KVLayout, history_lengths: Sequence[int], max_seq_len: int,
                 page_tokens: int, num_instances: int, available_bytes: int) -> CacheBudgets:
    """Budgets for ``num_instances`` instances serving users with ``history_lengths`` (all
    users; none: every prefix counts as ``max_seq_len`` long).

    The device tier always holds at least two prefixes of ``max_seq_len`` tokens, so that any
    request fits; the cap never goes below that.
    """
    assert num_instances >= 1 and page_tokens >= 1 and available_bytes >= 0
    read = [max(1, min(max_seq_len, int(n))) for n in history_lengths] or [max_seq_len]
    mean = sum(read) / len(read)
    per_token = layout.page_bytes(page_tokens) / page_tokens
    floor = int(2 * math.ceil(max_seq_len / page_tokens) * layout.page_bytes(page_tokens))
    device = max(floor, int(DEVICE_RESIDENT_USERS * mean * per_token))
    host = HOST_TO_DEVICE * device
    cap = MEMORY_FRACTION * available_bytes / num_instances
    capped = device + host > cap
    if capped:
        scale = cap / (device + host)
        device, host = max(floor, int(device * scale)), int(host * scale)
    return CacheBudgets(device, host, mean, math.ceil(per_token), capped)


def available_host_bytes() -> int:
    """Memory the kernel says a new allocation can get now (``MemAvailable``), Linux; else the
    physical memory."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
