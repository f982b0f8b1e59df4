"""The messages between the Ray ingress and its ranking replicas (picklable dataclasses).

Each leg of a request is one routed call: ``PreinferCall`` (first leg) and ``RankCall`` (second
leg) carry the user id the request router hashes, and the routing hints the router obeys:

* ``follow``: the second leg goes where the first went (the router's ``follow``), so the ranking
  request meets the prefix its pre-infer signal computed;
* ``avoid``: replicas this request already lost (failover to the user's next choice);
* ``target``: a control call for exactly one replica (snapshots, quiescing).

``note`` is written by the request router in the sending process just before the call leaves
(it is the router's decision: instance, reason, spill); the replica records it next to its own
identity, which is how tests compare the router's belief with where a leg really ran.

A prefix travels as its events (``PrefixPayload``); the replica rebuilds the ``PrefixSpec`` the
instance wants, deriving ``version_at`` from the events with the history store's hash, and
checks it against the version the ingress sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from relaygr.cascade.payload import UNKNOWN_VERSION, PrefixPayload
from relaygr.engine.types import PreinferResult, RankJob, RankPath
from relaygr.kvcache import PrefixId
from relaygr.server.snapshot import InstanceSnapshot

__all__ = ["UNKNOWN_VERSION", "ControlCall", "PrefixPayload", "PreinferCall", "PreinferReply",
           "RankCall", "RankReply", "ReplicaState", "RouteNote", "RoutedCall"]


@dataclass(frozen=True)
class RouteNote:
    """One routing decision: the chosen replica, why, and whether a load spill moved it."""

    instance_id: str
    reason: str
    spilled: bool


@dataclass(kw_only=True)
class RoutedCall:
    """Routing fields shared by every call to a ranking replica (see the module docstring)."""

    request_id: str
    user_id: int | None = None
    follow: RouteNote | None = None
    avoid: tuple[str, ...] = ()
    target: str | None = None
    note: RouteNote | None = None


@dataclass(kw_only=True)
class PreinferCall(RoutedCall):
    prefix: PrefixPayload
    suffix_tokens: int
    candidates: int


@dataclass(kw_only=True)
class RankCall(RoutedCall):
    prefix: PrefixPayload
    candidates: Tensor                      # [C] int64
    suffix_items: Tensor | None = None
    suffix_timestamps: Tensor | None = None
    query_ts: int | None = None
    grown: PrefixId | None = None

    def to_job(self) -> RankJob:
        return RankJob(self.prefix.to_spec(), self.candidates, self.suffix_items,
                       self.suffix_timestamps, self.query_ts, self.grown)


@dataclass(kw_only=True)
class ControlCall(RoutedCall):
    """A call for one replica (``target``), not for a user."""


@dataclass(frozen=True)
class PreinferReply:
    replica: str
    result: PreinferResult
    shed: bool                     # skipped because the replica's ranking queue was deep
    note: RouteNote | None


@dataclass(frozen=True)
class RankReply:
    """Scores, or ``overloaded_retry_s`` when the replica shed the request (no scores)."""

    replica: str
    scores: Tensor | None
    path: RankPath | None
    snapshot: InstanceSnapshot
    note: RouteNote | None
    overloaded_retry_s: float | None = None
    detail: str = ""


@dataclass(frozen=True)
class ReplicaState:
    """A replica's answer to a control call."""

    replica: str
    snapshot: InstanceSnapshot
    legs: dict[str, int] = field(default_factory=dict)
