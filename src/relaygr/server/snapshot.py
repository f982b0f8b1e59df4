"""Plain-data snapshots of serving state: what /metrics reports and what tests compare.

``InstanceSnapshot.of(instance)`` reads one ``RankingInstance`` (queues, cache tiers, paths,
trigger decisions) into frozen values that pickle across processes, so a Ray replica can send
its own snapshot to the ingress and the embedded server can read its instances in place: both
feed the same metrics collector. ``StateFingerprint`` is everything a request could change
(history store, counters, cache contents and statistics); a rejected request must leave it
equal.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from relaygr.cascade.store import HistoryStore
from relaygr.engine.instance import RankingInstance
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

    @classmethod
    def of(cls, instance: RankingInstance) -> InstanceSnapshot:
        res = instance.residency
        device = host = None
        residency: dict[str, int] = {}
        if res is not None:
            device = TierSnapshot.of(res.pool.stats)
            host = None if res.host is None else TierSnapshot.of(res.host.stats)
            residency = {k: v for k, v in asdict(res.counters).items() if isinstance(v, int)}
        trigger = {} if instance.trigger is None else \
            {reason.value: n for reason, n in instance.trigger.counts.items()}
        return cls(instance.name, instance.healthy, instance.scheduler.rank_queue_depth,
                   instance.scheduler.prefill_queue_depth, device, host,
                   dict(instance.paths), dict(instance.preinfer_actions), trigger, residency)


@dataclass(frozen=True)
class ServingCounters:
    """Whole-system counts (the cascade's, not one instance's)."""

    requests: int = 0
    failovers: int = 0
    shed_preinfer: int = 0
    shed_rank: int = 0
    remembered_prefills: int = 0    # /v1/prefill signals whose /v1/rank has not come yet


@dataclass(frozen=True)
class ServingSnapshot:
    instances: tuple[InstanceSnapshot, ...]
    counters: ServingCounters


@dataclass(frozen=True)
class StateFingerprint:
    """Everything a request can change; equal before and after any rejected request."""

    histories: tuple[tuple[int, int, int], ...]     # (user, events, version) per user
    serving: ServingSnapshot

    @classmethod
    def of(cls, store: HistoryStore, serving: ServingSnapshot) -> StateFingerprint:
        histories = tuple((user, store.num_events(user),
                           store.version_at(user, store.num_events(user))) for user in store)
        return cls(histories, serving)
