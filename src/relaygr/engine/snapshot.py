"""Plain-data snapshot of one ranking instance: queues, cache tiers, paths, trigger decisions.

Frozen values that pickle, so an instance in another process (an instance process, a Ray
replica) sends its snapshot and an in-process one is read in place; the server's /metrics and
the benchmark read both the same way. ``RankingInstance.snapshot`` fills one in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relaygr.kvcache import TierStats


@dataclass(frozen=True)
class TierSnapshot:
    """One cache tier (device pool or host DRAM tier) of one instance."""

    used_bytes: int
    budget_bytes: int
    unevictable_bytes: int
    entries: int
    pending: int
    in_use: int
    hits: int
    misses: int
    stale_misses: int
    admitted: int
    evictions: int
    expired: int
    aborted: int

    @classmethod
    def of(cls, stats: TierStats) -> TierSnapshot:
        return cls(stats.used_bytes, stats.budget_bytes, stats.unevictable_bytes,
                   stats.entries, stats.pending, stats.in_use, stats.hits, stats.misses,
                   stats.stale_misses, stats.admitted, stats.evictions, stats.expired,
                   stats.aborted)


@dataclass(frozen=True)
class InstanceSnapshot:
    """One ranking instance. ``device``/``host`` are None when the mode has no such tier."""

    name: str
    healthy: bool
    rank_queue_depth: int
    prefill_queue_depth: int
    device: TierSnapshot | None
    host: TierSnapshot | None
    paths: dict[str, int] = field(default_factory=dict)
    preinfer_actions: dict[str, int] = field(default_factory=dict)
    trigger: dict[str, int] = field(default_factory=dict)
    residency: dict[str, int] = field(default_factory=dict)
    # The worker's compute: rank_batches (rank_batches_on_loop of them on the event loop's
    # thread), rank_requests, prefill_rounds, rank_batches_split (failed batches run again one
    # request at a time), rank_requests_failed (counts) and rank_compute_s, prefill_compute_s
    # (seconds computing, no queueing).
    compute: dict[str, float] = field(default_factory=dict)
    # Host<->device copies (the expander's counters; empty without a host tier).
    expander: dict[str, int] = field(default_factory=dict)
    # Why ``healthy`` is false, where the reporter knows (the cascade's circuit breaker,
    # ``cascade.breaker``); None otherwise.
    unhealthy_reason: str | None = None
