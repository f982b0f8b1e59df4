"""Plain-data snapshots of serving state: what /metrics reports and what tests compare.

An instance's own snapshot (``InstanceSnapshot``, from ``relaygr.engine.snapshot``) pickles
across processes, so a Ray replica or an instance process sends its snapshot and the embedded
server reads its instances in place: both feed the same metrics collector.
``StateFingerprint`` is everything a request could change (history store, counters, cache
contents and statistics); a rejected request must leave it equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaygr.cascade.store import HistoryStore
from relaygr.engine.snapshot import InstanceSnapshot, TierSnapshot

__all__ = ["InstanceSnapshot", "ServingCounters", "ServingSnapshot", "StateFingerprint",
           "TierSnapshot"]


@dataclass(frozen=True)
class ServingCounters:
    """Whole-system counts (the cascade's, not one instance's)."""

    requests: int = 0
    failovers: int = 0
    shed_preinfer: int = 0
    shed_rank: int = 0
    remembered_prefills: int = 0    # /v1/prefill signals whose /v1/rank has not come yet
    instance_deaths: int = 0        # instance processes seen dead by the supervisor
    instance_restarts: int = 0      # ... and restarted on a new process
    instances_given_up: int = 0     # ... and left down after repeated failed restarts
    window_slides: int = 0          # appends that moved a user's history window (cascade.window)
    windowed_requests: int = 0      # ranked from a window that starts after the first event
    instance_hangs: int = 0         # instance processes killed by the supervisor for not answering
    # pre-infer signals that did nothing: instance gone, raised, or its ranking leg failed over
    lost_preinfer: int = 0
    instance_failed_restarts: int = 0  # restarts that failed (no process, or its build raised)
    instance_errors: int = 0        # failovers whose instance raised (its fault, not the request's)
    breaker_opens: int = 0          # instances taken out of routing by their circuit breaker


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
