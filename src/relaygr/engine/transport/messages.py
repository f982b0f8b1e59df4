"""The messages of a request's two legs across a boundary: one set for every transport.

A ranking instance in a worker process (``engine.transport.processes``, framed by
``engine.transport.host``) and one in a Ray Serve replica (``distributed.replica``) are sent the
same calls and answer with the same replies (picklable dataclasses):

* calls: ``PreinferCall`` (first leg), ``RankCall`` (second leg), ``ControlCall`` (one instance's
  lifecycle or state), ``Open`` (a worker process builds an instance);
* replies: ``PreinferReply``, ``RankReply`` (scores, or the shed rule's refusal),
  ``ReplicaState`` (a replica's answer to a control call); a worker process wraps each answer in
  a ``Reply`` (value or error, with a snapshot) and pushes snapshots (``Push``), or a
  ``Heartbeat`` when it holds no instance (``engine.transport.liveness``).

Every call carries the fields of ``RoutedCall``: ``iid`` names the instance within a worker
process; the rest is what Ray Serve's request router (``distributed.router``) reads:

* ``follow``: the second leg goes where the first went (the router's ``follow``), so the ranking
  request meets the prefix its pre-infer signal computed;
* ``avoid``: replicas this request already lost (failover to the user's next choice);
* ``target``: a control call for exactly one replica (snapshots, quiescing).

``note`` is written by the request router in the sending process just before the call leaves
(it is the router's decision: instance, reason, spill); the replica records it next to its own
identity, which is how tests compare the router's belief with where a leg really ran.

A prefix travels as its events (``PrefixPayload``): the receiver rebuilds the ``PrefixSpec``
the instance wants, deriving ``version_at`` from the events with the history store's hash
(``engine.versions``), and checks it against the version sent. Tensors travel as numpy arrays
(they pickle cheaply); scores come back bit-exact (the model's dtype travels with them).

The messages sit in the engine's transport layer, below the cascade, so that every transport and
the request path above them speak one set. Their routing and shed fields are plain data: the
rules that fill them are the router's (``routing``, ``distributed.router``) and the cascade's
(``cascade.fleet``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from relaygr.engine.snapshot import InstanceSnapshot
from relaygr.engine.transport.payload import PrefixPayload
from relaygr.engine.types import (
    PrefixSpec,
    PreinferResult,
    RankJob,
    RankPath,
    RankResult,
    RankTiming,
)
from relaygr.kvcache import PrefixId


@dataclass(frozen=True)
class RouteNote:
    """One routing decision: the chosen replica, why, and whether a load spill moved it."""

    instance_id: str
    reason: str
    spilled: bool


@dataclass(kw_only=True)
class RoutedCall:
    """The fields every call carries (see the module docstring)."""

    request_id: str = ""
    iid: int = 0
    user_id: int | None = None
    follow: RouteNote | None = None
    avoid: tuple[str, ...] = ()
    target: str | None = None
    note: RouteNote | None = None


@dataclass(kw_only=True)
class Open(RoutedCall):
    """Build instance ``iid`` (``name`` on ``device``) in a worker process for ``config`` (the
    system's config, opaque to the transport: the host hands it to its builder)."""

    config: Any
    name: str
    device: str


@dataclass(kw_only=True)
class PreinferCall(RoutedCall):
    prefix: PrefixPayload
    suffix_tokens: int
    candidates: int


@dataclass(kw_only=True)
class AbandonCall(RoutedCall):
    """``pid``'s pre-infer signal will see no ranking leg on this instance (shed, failed over):
    ``RankingInstance.abandon``."""

    pid: PrefixId


def _array(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.numpy()


def _tensor(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a)


@dataclass(kw_only=True)
class RankCall(RoutedCall):
    prefix: PrefixPayload
    candidates: np.ndarray                      # [C] int64
    suffix_items: np.ndarray | None = None
    suffix_timestamps: np.ndarray | None = None
    query_ts: int | None = None
    grown: PrefixId | None = None

    @classmethod
    def of(cls, job: RankJob, **routing: Any) -> RankCall:
        """``job`` as a call (``routing``: the ``RoutedCall`` fields)."""
        return cls(prefix=PrefixPayload.of(job.prefix), candidates=job.candidates.numpy(),
                   suffix_items=_array(job.suffix_items),
                   suffix_timestamps=_array(job.suffix_timestamps), query_ts=job.query_ts,
                   grown=job.grown, **routing)

    def to_job(self, prefix: PrefixSpec | None = None) -> RankJob:
        """The job again (``prefix``: the spec already rebuilt from this call's payload)."""
        spec = self.prefix.to_spec() if prefix is None else prefix
        return RankJob(spec, torch.from_numpy(self.candidates),
                       _tensor(self.suffix_items), _tensor(self.suffix_timestamps),
                       self.query_ts, self.grown)


@dataclass(kw_only=True)
class ControlCall(RoutedCall):
    """A call for one instance, not for a user: ``op`` is stop | fail | restart | idle |
    integrity | snapshot (worker process) or the replica method's name (Ray)."""

    op: str = "snapshot"


@dataclass(frozen=True)
class PreinferReply:
    instance: str
    result: PreinferResult
    shed: bool = False             # skipped by the shed rule (``cascade.fleet.sheds_preinfer``)
    note: RouteNote | None = None


@dataclass(frozen=True)
class RankReply:
    """Scores (``tensor()``), or ``overloaded_retry_s`` when the shed rule refused the leg."""

    instance: str
    scores: np.ndarray | None
    dtype: str = "float32"
    path: RankPath | None = None
    timing: RankTiming | None = None
    snapshot: InstanceSnapshot | None = None
    note: RouteNote | None = None
    overloaded_retry_s: float | None = None
    detail: str = ""

    @classmethod
    def ranked(cls, result: RankResult, snapshot: InstanceSnapshot | None = None,
               note: RouteNote | None = None) -> RankReply:
        scores = result.scores.detach().to("cpu")
        # numpy has no bfloat16: those travel as float32 (exact), every other dtype as itself
        array = scores.float().numpy() if scores.dtype == torch.bfloat16 else scores.numpy()
        return cls(result.instance, array, str(scores.dtype).removeprefix("torch."),
                   result.path, result.timing, snapshot, note)

    def tensor(self) -> torch.Tensor:
        """The scores in the model's dtype, bit-exact."""
        assert self.scores is not None, "a shed leg has no scores"
        return torch.from_numpy(self.scores).to(getattr(torch, self.dtype))


@dataclass(frozen=True)
class ReplicaState:
    """A replica's answer to a control call."""

    replica: str
    snapshot: InstanceSnapshot
    legs: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """A worker process's answer to one call (``error`` set when it raised), with the
    instance's snapshot when the call changed or asked for it."""

    value: Any = None
    error: BaseException | None = None
    snapshot: InstanceSnapshot | None = None


@dataclass(frozen=True)
class Push:
    """An instance's latest snapshot, pushed by its worker process every ``push_interval_s``."""

    iid: int
    snapshot: InstanceSnapshot


@dataclass(frozen=True)
class Heartbeat:
    """A worker process's sign of life when it holds no instance whose snapshot it could push
    (the parent judges a silent process hung: ``engine.transport.liveness``)."""
