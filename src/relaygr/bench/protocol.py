"""The contract between the benchmark and a system it measures.

The benchmark drives a ``RankingSystem`` (one mode of the relay: ``baseline``, ``reactive``,
``relay`` or an ablation) with ``BenchRequest`` visits and reads back one ``RequestRecord`` per
visit. It knows nothing else about the system; a factory (``SystemFactory``) builds a fresh system
for every measured point from a ``SystemContext``.

Clock: every time in a request or record is seconds on the run's clock, ``RunClock.now_s()``
(the event loop's time minus the run start). The runner starts the clock just before the first
request is due; the system reads the same clock object through its context.

Invariants of a record (checked by the runner; a violation raises ``BenchProtocolError``):
``send_s <= ranking_due_s <= ranking_done_s <= e2e_done_s`` and ``request_id`` matches the request.
Systems must not block the event loop (run model work in a worker thread): a blocked loop sends
later requests late, which the runner still charges to them (latency counts from the scheduled
send time) and reports as dispatch lag.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# A workload is what makes requests; this module says what a system does with them.
from relaygr.bench.layout import Layout
from relaygr.bench.workload.base import BenchRequest, Workload
from relaygr.engine.types import RankPath
from relaygr.wake import sleep_until

# The paths a record names (``RequestRecord.path``) are the engine's ``RankPath`` values, which
# the systems report; these groupings of them are the ones statistics single out.
# Served from device K/V computed ahead of ranking (ready, or awaited while running).
DEVICE_SERVED_PATHS = (RankPath.DEVICE_HIT.value, RankPath.PENDING_WAIT.value)
# Ranked from a cached prefix, wherever it came from: the relay path.
RELAYED_PATHS = (*DEVICE_SERVED_PATHS, RankPath.HOST_HIT.value)


@dataclass(frozen=True)
class LatencyParts:
    """Where one request's ranking latency went, as far as the system can tell (seconds).

    ``lookup_s``: finding the prefix (waiting for a pre-infer or reload still running);
    ``queue_s``: behind other compute on the instance; ``compute_s``: the model pass of its
    batch; ``transport_s``: the hop to an instance in another process and back;
    ``handoff_s``: from the request's due (when the earlier stages would have ended had it
    started on time) to the cascade's call to ranking: a late send, the stage timer's
    overshoot, the front end's work before the call (a front end short of CPU shows here).
    What the ranking latency holds beyond their sum (routing, the event loops, the hand-offs
    to and from the instance's worker thread) is reported as ``other``.
    """

    lookup_s: float
    queue_s: float
    compute_s: float
    transport_s: float = 0.0
    handoff_s: float = 0.0


@dataclass(frozen=True)
class RequestRecord:
    """What the system reports for one request; all times on the run's clock.

    Ranking latency is ``ranking_done_s - ranking_due_s``; end-to-end latency is
    ``e2e_done_s - send_s`` of the request (its scheduled send time). ``scores`` are kept only
    when the context asks for them (exactness replay).
    """

    request_id: int
    user_id: int
    ranking_due_s: float
    ranking_done_s: float
    e2e_done_s: float
    path: str
    prefix_tokens: int
    suffix_tokens: int
    candidates: int
    preinfer_tokens: int
    trigger_reason: str | None
    scores: tuple[float, ...] | None = None
    parts: LatencyParts | None = None

    @property
    def ranking_latency_s(self) -> float:
        return self.ranking_done_s - self.ranking_due_s


@dataclass(frozen=True)
class SystemSnapshot:
    """System state at one instant: bytes in use per tier and named counters.

    ``counters`` holds anything else the system exposes (hits, trigger decisions by reason...);
    the benchmark reports them as they are.
    """

    device_bytes_in_use: int = 0
    host_bytes_in_use: int = 0
    counters: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, values: Mapping[str, float]) -> SystemSnapshot:
        """Read ``device_bytes_in_use``/``host_bytes_in_use``; every other key is a counter."""
        device = int(values.get("device_bytes_in_use", 0))
        host = int(values.get("host_bytes_in_use", 0))
        counters = {k: float(v) for k, v in values.items()
                    if k not in ("device_bytes_in_use", "host_bytes_in_use")}
        return cls(device, host, counters)


@runtime_checkable
class RankingSystem(Protocol):
    """One mode of the relay, as the benchmark sees it."""

    async def handle(self, request: BenchRequest) -> RequestRecord: ...


@runtime_checkable
class SupportsSnapshot(Protocol):
    """Optional: a system that can report its state (sampled during a run)."""

    def snapshot(self) -> SystemSnapshot | Mapping[str, float]: ...


@runtime_checkable
class SupportsRefresh(Protocol):
    """Optional: a system whose snapshot lags its state (parts in other processes push theirs
    periodically); ``refresh`` brings it up to date before the run's final snapshot."""

    async def refresh(self) -> None: ...


@runtime_checkable
class SupportsLifecycle(Protocol):
    """Optional: a system with background work to start before and stop after a run."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def take_snapshot(system: object) -> SystemSnapshot | None:
    """The system's snapshot as a ``SystemSnapshot``, or None when it offers none."""
    if not isinstance(system, SupportsSnapshot):
        return None
    raw = system.snapshot()
    return raw if isinstance(raw, SystemSnapshot) else SystemSnapshot.from_mapping(raw)


class RunClock:
    """Seconds since the run started, on the clock of the event loop that started it.

    The loop's clock is the one ``asyncio.sleep`` and timeouts run on (``time.monotonic()`` on a
    standard loop), so sends scheduled with ``sleep_until`` and the times records carry agree;
    a test loop on virtual time makes every latency an exact function of the schedule. Safe to
    read from other threads. Not started: ``now_s`` raises (an assertion: reading it early is a
    bug in the caller).
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._origin = 0.0

    def start(self) -> None:
        """Start at the running loop's current time (call it inside the loop)."""
        self._loop = asyncio.get_running_loop()
        self._origin = self._loop.time()

    @property
    def started(self) -> bool:
        return self._loop is not None

    def now_s(self) -> float:
        assert self._loop is not None, "RunClock read before the run started"
        return self._loop.time() - self._origin

    async def sleep_until(self, t_s: float) -> None:
        """Until ``t_s`` on the run clock, to within about 0.1 ms (``relaygr.wake``: asyncio's
        own timer ends up to 1 ms late, which the ranking latency would charge the system).
        An overdue send still yields once, so started requests make progress between sends."""
        assert self._loop is not None, "RunClock read before the run started"
        await sleep_until(self._origin + t_s)


@dataclass(frozen=True, eq=False)
class SystemContext:
    """What a factory gets to build a fresh system for one measured point.

    ``workload.histories`` is the initial history store content; ``workload.stage_delays`` are the
    retrieval and pre-processing delays the cascade should apply. ``keep_scores`` asks the system
    to fill ``RequestRecord.scores`` (exactness replay only: it costs memory).
    ``batch_max_requests``, when set, caps how many queued requests one model call may merge
    (the benchmark's choice for this mode at this point; None: the system's own setting);
    ``layout``, when set, is how many ranking instances of how many threads each the system
    serves on (the benchmark's choice likewise; None: the system's own).
    """

    workload: Workload
    clock: RunClock
    keep_scores: bool = False
    seed: int = 0
    batch_max_requests: int | None = None
    layout: Layout | None = None


SystemFactory = Callable[[SystemContext], RankingSystem]
