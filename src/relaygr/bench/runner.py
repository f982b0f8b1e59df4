"""Open-loop load generation: every request is sent at its scheduled time, whatever happens.

The dispatcher never waits for a response before sending the next request (no coordinated
omission), and every latency is measured from the request's *scheduled* send time, so a late
dispatch (a blocked event loop) is charged to the request, and shows up as dispatch lag.

Rules of one run:
- The first ``warmup_requests`` of the schedule are sent but excluded from the results.
- At most ``max_in_flight`` requests are outstanding; a request due while the cap is reached is
  dropped (counted, never delayed): the schedule holds even when the system cannot keep up.
- After the last send, outstanding requests get ``drain_timeout_s``; the rest are cancelled and
  counted as timed out. Dropped, failed and timed-out requests count as infinite latency.
- With ``slo_ms`` and a ``rule`` (``relaygr.bench.decision``), the run's P99 verdict is judged
  after every outcome, sequentially (the rule's ``sequential`` levels for the run's size), and
  the result carries it (``RunResult.decision``). A fail is judged on every due request (those
  without an outcome yet count as served in time, which only delays a fail); a pass on the
  longest run of requests from the first measured one, in schedule order, whose outcomes are
  all known (the stages before ranking keep a few requests in flight at any time, so a pass
  that waited for none to be in flight would wait for a lull). With ``stop_when_decided`` the
  run stops as soon as the verdict is reached, sending nothing further: on a fail the requests
  in flight are cancelled (they count as misses, which cannot undo a fail); on a pass they are
  drained and recorded, outside the sample that decided it (the test looked at a prefix of the
  schedule and stopped there; what came after is not part of it).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from relaygr.bench.decision import P99Decision, P99Rule, Verdict
from relaygr.bench.progress import NullProgress, Progress
from relaygr.bench.protocol import (
    BenchRequest,
    RankingSystem,
    RequestRecord,
    RunClock,
    SupportsLifecycle,
    SupportsRefresh,
    SystemContext,
    SystemFactory,
    SystemSnapshot,
    take_snapshot,
)
from relaygr.bench.workload import Workload
from relaygr.errors import BenchProtocolError, ConfigError


@dataclass(frozen=True)
class RunOptions:
    """How one point is driven (see the module docstring for each rule)."""

    warmup_requests: int = 0
    max_in_flight: int = 256
    drain_timeout_s: float = 30.0
    slo_ms: float | None = None
    rule: P99Rule | None = None
    stop_when_decided: bool = False
    snapshot_interval_s: float = 0.25

    def __post_init__(self) -> None:
        if self.warmup_requests < 0 or self.max_in_flight < 1:
            raise ConfigError("warmup_requests must be >= 0 and max_in_flight >= 1")
        if self.drain_timeout_s < 0 or self.snapshot_interval_s <= 0:
            raise ConfigError("drain_timeout_s must be >= 0 and snapshot_interval_s > 0")
        if (self.rule is None) != (self.slo_ms is None):
            raise ConfigError("an SLO verdict needs both slo_ms and rule")
        if self.stop_when_decided and self.rule is None:
            raise ConfigError("stop_when_decided needs slo_ms and rule")


@dataclass(frozen=True)
class RunResult:
    """Outcome of one point: records of completed measured requests and counts of the rest.

    Counts cover the measured requests only (after warm-up): ``measured == completed + dropped +
    failed + timed_out + not_sent + cancelled``. ``cancelled``: in flight when the point stopped
    on a fail it had decided, and ended by the runner, not by the system: their latency is not
    known, so they are left out of the latency figures (counted as timed out, they made every
    failing point's P99 infinite). ``dispatch_lag_s`` holds, per measured request actually sent,
    how late the dispatcher sent it after its scheduled time.
    """

    records: tuple[RequestRecord, ...]
    measured: int
    completed: int
    dropped: int
    failed: int
    timed_out: int
    not_sent: int
    errors: dict[str, int]
    dispatch_lag_s: tuple[float, ...]
    snapshots: tuple[SystemSnapshot, ...]
    duration_s: float
    stopped_early: bool
    send_s: dict[int, float]     # measured request id -> scheduled send time
    # The P99 verdict: the one the run stopped on (a pass: over the run of measured requests
    # from the first whose outcomes decided it; a fail: over the requests due then), else over
    # every due measured request; None without an SLO. The point's latency statistics cover
    # every record, those drained after a pass included.
    decision: P99Decision | None = None
    cancelled: int = 0

    @property
    def unserved(self) -> int:
        """Measured requests that count as infinite latency."""
        return self.dropped + self.failed + self.timed_out

    @property
    def sent(self) -> int:
        """Measured requests that were due before the run stopped and whose outcome is known
        (all but ``not_sent`` and ``cancelled``)."""
        return self.measured - self.not_sent - self.cancelled

    def misses(self, slo_ms: float) -> int:
        """Sent measured requests whose ranking latency exceeded ``slo_ms`` (unserved ones
        included)."""
        late = sum(r.ranking_latency_s * 1e3 > slo_ms for r in self.records)
        return late + self.unserved


class _Run:
    """State of one open-loop run (a helper of ``run_open_loop``)."""

    def __init__(self, system: RankingSystem, requests: tuple[BenchRequest, ...],
                 clock: RunClock, options: RunOptions, progress: Progress) -> None:
        self.system, self.requests, self.clock = system, requests, clock
        self.options, self.progress = options, progress
        self.measured_from = min(options.warmup_requests, len(requests))
        self.measured = len(requests) - self.measured_from
        self.records: dict[int, RequestRecord] = {}
        self.counts = {"dropped": 0, "failed": 0, "timed_out": 0, "not_sent": 0, "cancelled": 0}
        self.abandoning = False   # the point failed: what is still in flight is cancelled
        self.errors: dict[str, int] = {}
        self.protocol_errors: list[str] = []
        self.lags: list[float] = []
        self.in_flight: set[asyncio.Task[None]] = set()
        self.sent: list[BenchRequest] = []
        self.accounted: set[int] = set()   # request ids with an outcome
        self.due = 0        # measured requests whose send time came (sent or dropped)
        self.misses = 0     # ... of which over the SLO (unserved ones included)
        assert all(r.request_id == i for i, r in enumerate(requests)), \
            "request ids must be their positions in the schedule"
        # per measured request in schedule order: None until its outcome, then whether it missed
        self.missed: list[bool | None] = [None] * self.measured
        self.known = 0          # measured requests from the first whose outcomes are all known
        self.known_misses = 0   # ... of which over the SLO
        self.judged: P99Decision | None = None   # the verdict the run stopped on
        self.stop = asyncio.Event()
        rule = options.rule
        self.rule = None if rule is None else rule.sequential(self.measured)

    def _is_measured(self, request: BenchRequest) -> bool:
        return request.request_id >= self.measured_from

    def _count(self, request: BenchRequest, outcome: str) -> None:
        self.accounted.add(request.request_id)
        if self._is_measured(request):
            self.counts[outcome] += 1
            if outcome != "cancelled":      # a cancelled request's outcome is not known
                self._outcome(request, missed=True)

    def _outcome(self, request: BenchRequest, missed: bool) -> None:
        self.misses += missed
        self.missed[request.request_id - self.measured_from] = missed
        while self.known < self.measured and self.missed[self.known] is not None:
            self.known_misses += bool(self.missed[self.known])
            self.known += 1
        self._judge()

    def _judge(self) -> None:
        """Stop once the sample decides the P99 verdict (module docstring): a fail on the
        misses among the due requests, a pass on the known run from the first."""
        if self.rule is None or not self.options.stop_when_decided or self.stop.is_set():
            return
        if self.rule.verdict(self.due, self.misses) is Verdict.FAIL:
            self.judged = P99Decision.of(self.rule, self.due, self.misses)
        elif self.rule.verdict(self.known, self.known_misses) is Verdict.PASS:
            self.judged = P99Decision.of(self.rule, self.known, self.known_misses)
        else:
            return
        self.stop.set()

    def decision(self) -> P99Decision | None:
        if self.rule is None:
            return None
        return self.judged or P99Decision.of(self.rule, self.due, self.misses)

    async def dispatch(self) -> None:
        for index, request in enumerate(self.requests):
            await self.clock.sleep_until(request.send_s)
            if self.stop.is_set():
                self.counts["not_sent"] += sum(self._is_measured(r) for r in self.requests[index:])
                return
            if self._is_measured(request):         # warm-up's lag is the warm-up's
                self.lags.append(max(0.0, self.clock.now_s() - request.send_s))
            self.due += self._is_measured(request)
            if len(self.in_flight) >= self.options.max_in_flight:
                self._count(request, "dropped")
                self.progress.advance()
                continue
            self.sent.append(request)
            task = asyncio.create_task(self._serve(request))
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)

    async def _serve(self, request: BenchRequest) -> None:
        try:
            record = await self.system.handle(request)
        except asyncio.CancelledError:
            self._count(request, "cancelled" if self.abandoning else "timed_out")
            raise
        except Exception as exc:  # a failing system is measured, not fatal
            self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
            self._count(request, "failed")
        else:
            self._accept(request, record)
        finally:
            self.progress.advance()

    def _accept(self, request: BenchRequest, record: RequestRecord) -> None:
        self.accounted.add(request.request_id)
        problem = check_record(request, record)
        if problem:
            self.protocol_errors.append(problem)
            return
        if not self._is_measured(request):
            return
        self.records[request.request_id] = record
        slo_ms = self.options.slo_ms
        self._outcome(request, slo_ms is not None and record.ranking_latency_s * 1e3 > slo_ms)

    async def drain(self) -> None:
        # a fail is decided: what is in flight cannot change it (a pass waits for its requests)
        failed = self.judged is not None and self.judged.verdict is Verdict.FAIL
        timeout = 0.0 if failed else self.options.drain_timeout_s
        if self.in_flight:
            await asyncio.wait(set(self.in_flight), timeout=timeout)
        self.abandoning = failed      # else: past the drain timeout, a timeout of the system's
        for task in list(self.in_flight):
            task.cancel()
        if self.in_flight:
            await asyncio.gather(*self.in_flight, return_exceptions=True)
        for request in self.sent:  # cancelled before its coroutine ever ran
            if request.request_id not in self.accounted:
                self._count(request, "cancelled" if failed else "timed_out")


def check_record(request: BenchRequest, record: RequestRecord) -> str | None:
    """Why ``record`` breaks the protocol for ``request``, or None when it is consistent."""
    eps = 1e-6
    if record.request_id != request.request_id or record.user_id != request.user_id:
        return f"record {record.request_id}/{record.user_id} answers request " \
               f"{request.request_id}/{request.user_id}"
    times = (request.send_s, record.ranking_due_s, record.ranking_done_s, record.e2e_done_s)
    if any(later < earlier - eps for earlier, later in itertools.pairwise(times)):
        return f"request {request.request_id}: times not ordered send <= due <= done <= e2e: " \
               f"{times}"
    return None


async def _sample_snapshots(system: RankingSystem, interval_s: float,
                            out: list[SystemSnapshot]) -> None:
    while True:
        snap = take_snapshot(system)
        if snap is None:
            return
        out.append(snap)
        await asyncio.sleep(interval_s)


async def run_open_loop(system: RankingSystem, requests: tuple[BenchRequest, ...],
                        clock: RunClock, options: RunOptions,
                        progress: Progress | None = None) -> RunResult:
    """Drive ``system`` with ``requests`` open-loop; starts ``clock`` at the first instant.

    Raises ``BenchProtocolError`` when the system returned an inconsistent record.
    """
    run = _Run(system, requests, clock, options, progress or NullProgress())
    snapshots: list[SystemSnapshot] = []
    clock.start()
    sampler = asyncio.create_task(_sample_snapshots(system, options.snapshot_interval_s,
                                                    snapshots))
    try:
        await run.dispatch()
        await run.drain()
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    duration_s = clock.now_s()
    if isinstance(system, SupportsRefresh):
        await system.refresh()
    final = take_snapshot(system)
    if final is not None:
        snapshots.append(final)
    if run.protocol_errors:
        raise BenchProtocolError(f"{len(run.protocol_errors)} inconsistent records; first: "
                                 f"{run.protocol_errors[0]}")
    records = tuple(run.records[k] for k in sorted(run.records))
    assert run.measured == len(records) + sum(run.counts.values()), \
        f"unaccounted requests: {run.measured} measured, {len(records)} completed, {run.counts}"
    return RunResult(
        records=records, measured=run.measured, completed=len(records),
        dropped=run.counts["dropped"], failed=run.counts["failed"],
        timed_out=run.counts["timed_out"], not_sent=run.counts["not_sent"],
        cancelled=run.counts["cancelled"],
        errors=dict(run.errors), dispatch_lag_s=tuple(run.lags), snapshots=tuple(snapshots),
        duration_s=duration_s, stopped_early=run.stop.is_set(),
        send_s={r.request_id: r.send_s for r in requests[run.measured_from:]},
        decision=run.decision())


async def run_point(factory: SystemFactory, workload: Workload, options: RunOptions,
                    progress: Progress | None = None, keep_scores: bool = False) -> RunResult:
    """Build a fresh system for ``workload``, start it, run the point, stop it."""
    clock = RunClock()
    system = factory(SystemContext(workload, clock, keep_scores, workload.seed))
    lifecycle = system if isinstance(system, SupportsLifecycle) else None
    if lifecycle is not None:
        await lifecycle.start()
    try:
        return await run_open_loop(system, workload.requests, clock, options, progress)
    finally:
        if lifecycle is not None:
            await lifecycle.stop()
