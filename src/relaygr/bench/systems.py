"""The relay system under the benchmark: a ``RankingSystem`` per mode, fresh for every point.

``CascadeUnderTest`` adapts ``RelaySystem.recommend`` to the benchmark protocol: a visit goes
through the whole cascade (pre-infer signal, retrieval, pre-processing, ranking) and comes back
as a ``RequestRecord`` on the run's clock. Ranking latency runs from the moment pre-processing
hands the ranking request over (the ranking stage cannot start earlier) to its scores: queueing
and compute at the ranking instance. End-to-end latency runs from the visit's *scheduled* send
time, so any lateness (a late dispatch, an earlier stage finishing after its configured delay,
an event loop kept busy) is charged there rather than hidden.

``mode_factories`` builds one factory per mode; all modes share the model, the fitted latency
cost model and the retrieval index (built once), and each point gets a fresh history store from
the point's workload, so no mode inherits another's caches.

Retrieval and pre-processing run on their own fleets in production, not on the ranking machine,
so the benchmark runs retrieval for every visit of a workload before the point's clock starts
(``SharedParts.book_for``, once per workload, shared by the modes measured on it) and during the
point the earlier stages only take their configured delays. The two cores then serve the ranking
tier alone. Measured before this change: retrieval (a flat FAISS search over 50,000 items plus
the history filter) cost 2.2 ms of CPU per visit; the relay's ranking P99 at 48 QPS and 512
tokens was 78-823 ms in nine runs with it and 31-169 ms in five with random candidates in its
place (docs/benchmark.md). A workload served by a trained retrieval stage
(``SharedParts.measured``, ``relaygr bench --retrieval-run``) is the exception: its retrieval is
real work on the request's path, measured live, and the simulated delays are 0.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from relaygr.bench.layout import Layout
from relaygr.bench.protocol import (
    BenchRequest,
    LatencyParts,
    RequestRecord,
    RunClock,
    SystemContext,
    SystemFactory,
    SystemSnapshot,
)
from relaygr.bench.workload import Workload
from relaygr.cascade.config import MEASURED_STAGE_DELAYS, SystemConfig
from relaygr.cascade.proposals import RetrievalStage
from relaygr.cascade.stages import CandidateBook, EarlierStages
from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Visit
from relaygr.engine.transport.processes import InstanceProcesses, ProcessInstance
from relaygr.errors import ConfigError
from relaygr.model import HSTU
from relaygr.relay.costmodel import LatencyCostModel

# A visit this soon after the user's previous one may reach retrieval before the previous
# visit's events are appended (that happens after its ranking): the book holds both histories.
_APPEND_RACE_S = 2.0


class CascadeUnderTest:
    """One mode of the relay as the benchmark drives it (see the module docstring)."""

    def __init__(self, system: RelaySystem, clock: RunClock, keep_scores: bool) -> None:
        self.system = system
        self.clock = clock
        self.keep_scores = keep_scores

    async def start(self) -> None:
        await self.system.start()

    async def stop(self) -> None:
        await self.system.stop()

    async def refresh(self) -> None:
        """Fetch the instances' snapshots now where they live in other processes."""
        await asyncio.gather(*(inst.refresh() for inst in self.system.instances
                               if isinstance(inst, ProcessInstance)))

    async def handle(self, request: BenchRequest) -> RequestRecord:
        rec = await self.system.recommend(Visit(
            request.user_id, request.recent_items, request.recent_timestamps,
            request.request_ts, request.num_candidates))
        offset = self.clock.now_s() - time.perf_counter()     # perf_counter -> run clock
        done = rec.ranking_done_s + offset
        due = min(max(rec.ranking_due_s + offset, request.send_s), done)
        if rec.stages is not None:
            # due when the earlier stages would have ended had the request started on time:
            # its scheduled send plus their own time (the configured delays, or the measured
            # retrieval where that took longer). A request the loop started late, or handed
            # over late, is charged that lag in its ranking latency, not hidden before it.
            took = max(rec.stages.retrieval_s, self.system.config.stages.delay_s)
            due = min(due, request.send_s + took)
        # the cascade's call to ranking, on the run clock: after ``due`` by the hand-over lag
        handoff = max(min(rec.ranking_due_s + offset, done) - due, 0.0)
        pre = rec.preinfer
        return RequestRecord(
            request_id=request.request_id, user_id=request.user_id, ranking_due_s=due,
            ranking_done_s=done, e2e_done_s=max(done, self.clock.now_s()),
            path=rec.path.value, prefix_tokens=rec.prefix_tokens,
            suffix_tokens=rec.suffix_tokens, candidates=int(rec.candidates.numel()),
            preinfer_tokens=0 if pre is None else pre.tokens,
            trigger_reason=None if pre is None or pre.reason is None else pre.reason.value,
            scores=tuple(rec.scores.tolist()) if self.keep_scores else None,
            parts=None if (t := rec.timing) is None else LatencyParts(
                t.lookup_s, t.queue_s, t.compute_s, t.transport_s, handoff))

    def snapshot(self) -> SystemSnapshot:
        device = host = 0
        counters: dict[str, float] = {}

        def add(name: str, value: float) -> None:
            counters[name] = counters.get(name, 0.0) + value

        for inst in self.system.instances:
            snap = inst.snapshot()
            for name in ("rank_batches", "rank_compute_s", "prefill_compute_s"):
                add(name, snap.compute.get(name, 0.0))    # worker compute: what queueing is not
            if snap.device is not None:
                device += snap.device.used_bytes
                add("device_evictions", snap.device.evictions)
                add("admission_refused", snap.residency.get("admission_refused", 0))
                add("background_failed", snap.residency.get("background_failed", 0))
            if snap.host is not None:
                host += snap.host.used_bytes
                add("reload_copies", snap.expander.get("reload_copies", 0))
                add("demotion_copies", snap.expander.get("demotion_copies", 0))
            for reason, n in snap.trigger.items():
                add(f"trigger_{reason}", n)
        add("retrieval_replayed", self.system.stages.replayed)
        add("retrieval_live", self.system.stages.retrieved)
        add("shed_preinfer", self.system.counters.shed_preinfer)
        add("shed_rank", self.system.counters.shed_rank)
        add("failovers", self.system.counters.failovers)
        add("instance_errors", self.system.counters.instance_errors)   # failovers it raised
        return SystemSnapshot(device, host, counters)


@dataclass(frozen=True)
class SharedParts:
    """What every mode's systems share: built once per benchmark run."""

    model: HSTU
    cost_model: LatencyCostModel
    retrieval: RetrievalStage
    # Where the ranking instances run: None, in the benchmark's own process (worker threads
    # sharing one GIL); else one process each (``relaygr.engine.transport.processes``).
    processes: InstanceProcesses | None = None
    # Trained retrieval stages by workload name (workloads whose item ids are a dataset's):
    # their visits retrieve live, on the request's path and measured, with no simulated delays.
    measured: Mapping[str, RetrievalStage] = field(default_factory=dict)
    _books: OrderedDict[int, tuple[Workload, CandidateBook]] = field(
        default_factory=OrderedDict, repr=False, compare=False)
    _placed: dict[Layout, InstanceProcesses] = field(default_factory=dict, repr=False,
                                                      compare=False)

    def processes_on(self, layout: Layout) -> InstanceProcesses:
        """Instance processes of ``layout`` (``processes`` where it is that layout; else
        started once on first use, ended by ``close``). Instances on threads of this process
        have no layout to choose: ``ConfigError``."""
        if self.processes is None:
            raise ConfigError("a layout of instances needs instances in processes")
        spec = self.processes.spec
        if (self.processes.num_processes, spec.torch_threads) == (layout.instances,
                                                                  layout.threads):
            return self.processes
        if layout not in self._placed:
            self._placed[layout] = InstanceProcesses.for_model(
                self.model, self.cost_model, layout.instances, torch_threads=layout.threads,
                build=spec.build)
        return self._placed[layout]

    def close(self) -> None:
        """End the processes ``processes_on`` started (``processes`` is its owner's)."""
        for processes in self._placed.values():
            processes.close()
        self._placed.clear()

    def book_for(self, workload: Workload, config: SystemConfig) -> CandidateBook:
        """Every visit's retrieval result, computed as the cascade would at that visit (the
        history grown by the earlier visits' events). Kept for the latest two workloads: the
        modes of a lock-step round measure the same one."""
        key = id(workload)
        cached = self._books.get(key)
        if cached is not None and cached[0] is workload:
            return cached[1]
        stages = EarlierStages(self.retrieval, config.stages.retrieval_k, 0.0, 0.0)
        book = CandidateBook()
        grown = {user: h.items for user, h in workload.histories.items()}
        before: dict[int, tuple[float, np.ndarray]] = {}   # user -> (last send, history then)
        try:
            for request in workload.requests:
                user, n = request.user_id, request.num_candidates or config.stages.num_candidates
                recent = np.asarray(request.recent_items, dtype=np.int64)
                variants = [grown[user]]
                last = before.get(user)
                if last is not None and request.send_s - last[0] < _APPEND_RACE_S:
                    variants.append(last[1])   # the previous visit's events not appended yet
                for history in variants:
                    seen = np.concatenate([history, recent])
                    book.add(user, seen, n, *stages.candidates(seen, n, user))
                before[user] = (request.send_s, grown[user])
                grown[user] = np.concatenate([grown[user], recent])
        finally:
            stages.shutdown()
        self._books[key] = (workload, book)
        while len(self._books) > 2:
            self._books.popitem(last=False)
        return book


def mode_factories(modes: Sequence[str], base: SystemConfig, parts: SharedParts
                   ) -> dict[str, SystemFactory]:
    """A factory per mode building a ``CascadeUnderTest`` over the point's workload."""

    def factory_for(mode: str) -> SystemFactory:
        def build(ctx: SystemContext) -> CascadeUnderTest:
            trained = parts.measured.get(ctx.workload.name)
            delays = ctx.workload.stage_delays
            config = base.with_(mode=mode, stages={"retrieval_delay_ms": delays.retrieval_ms,
                                                   "preprocess_delay_ms": delays.preprocessing_ms})
            retrieval, book = parts.retrieval, None
            if trained is None:
                book = parts.book_for(ctx.workload, config)
            else:
                config, retrieval = base.with_(mode=mode, stages=MEASURED_STAGE_DELAYS), trained
            if ctx.batch_max_requests is not None:   # the benchmark's batch cap for this point
                config = config.with_(instance={"batch": {"max_requests": ctx.batch_max_requests}})
            processes = parts.processes
            if ctx.layout is not None:                # and its layout
                config = config.with_(num_instances=ctx.layout.instances)
                processes = parts.processes_on(ctx.layout)
            store = InMemoryHistoryStore.from_sequences(
                {user: (h.items, h.timestamps) for user, h in ctx.workload.histories.items()},
                num_items=ctx.workload.num_items)
            factory = None if processes is None else processes.factory
            system = RelaySystem(config, parts.model, store, parts.cost_model, retrieval, book,
                                 factory)
            return CascadeUnderTest(system, ctx.clock, ctx.keep_scores)
        return build

    return {mode: factory_for(mode) for mode in modes}
