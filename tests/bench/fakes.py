"""Fake ranking systems with known answers (no model): simulated single FIFO servers.

``SimulatedServer`` computes each request's service in *virtual* time from its scheduled send
time (Lindley's recursion: start = max(due, previous finish)), then really waits until that
finish, so the runner sees genuine in-flight requests while the recorded latencies are an exact
function of the schedule. ``lindley_p99_ms`` computes the same answer offline.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import numpy as np

from relaygr.bench.protocol import BenchRequest, RequestRecord, SystemContext, SystemSnapshot
from relaygr.bench.workload import Workload


def service_time(base_s: float, per_token_s: float) -> Callable[[int], float]:
    return lambda prefix_tokens: base_s + per_token_s * prefix_tokens


def scores_for(request: BenchRequest, prefix_tokens: int) -> tuple[float, ...]:
    return tuple(math.sin(request.user_id * 1e-3 + k + prefix_tokens * 1e-4)
                 for k in range(request.num_candidates))


class SimulatedServer:
    """One FIFO server: service_s = f(prefix tokens); records computed in virtual time."""

    def __init__(self, ctx: SystemContext, service_s: Callable[[int], float],
                 path: str = "full", score_noise: float = 0.0,
                 bytes_per_token: int = 0) -> None:
        self.ctx, self.clock = ctx, ctx.clock
        self.service_s, self.path, self.score_noise = service_s, path, score_noise
        self.delay_s = ctx.workload.stage_delays.total_s
        self.prefix = {u: len(h) for u, h in ctx.workload.histories.items()}
        self.free_at_s = 0.0
        self.arrivals_s: dict[int, float] = {}
        self.bytes_per_token = bytes_per_token
        self.served = 0
        self.started = self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def snapshot(self) -> SystemSnapshot:
        tokens = sum(self.prefix.values())
        return SystemSnapshot(device_bytes_in_use=tokens * self.bytes_per_token,
                              host_bytes_in_use=0, counters={"served": float(self.served)})

    async def handle(self, request: BenchRequest) -> RequestRecord:
        self.arrivals_s[request.request_id] = self.clock.now_s()
        due = request.send_s + self.delay_s
        prefix = self.prefix[request.user_id]
        done = max(due, self.free_at_s) + self.service_s(prefix)
        self.free_at_s = done
        self.prefix[request.user_id] += len(request.recent_items)
        await self.clock.sleep_until(done)
        self.served += 1
        scores = None
        if self.ctx.keep_scores:
            scores = tuple(s + self.score_noise for s in scores_for(request, prefix))
        return RequestRecord(
            request_id=request.request_id, user_id=request.user_id, ranking_due_s=due,
            ranking_done_s=done, e2e_done_s=done, path=self.path, prefix_tokens=prefix,
            suffix_tokens=len(request.recent_items), candidates=request.num_candidates,
            preinfer_tokens=prefix if self.path != "full" else 0,
            trigger_reason="admitted" if self.path != "full" else None, scores=scores)


class SpikyServer(SimulatedServer):
    """Serves in ``base_s``, but the requests in ``spikes`` take ``spike_s``."""

    def __init__(self, ctx: SystemContext, base_s: float, spikes: set[int],
                 spike_s: float) -> None:
        super().__init__(ctx, service_time(base_s, 0.0))
        self.base_s, self.spikes, self.spike_s = base_s, spikes, spike_s

    async def handle(self, request: BenchRequest) -> RequestRecord:
        cost = self.spike_s if request.request_id in self.spikes else self.base_s
        self.service_s = service_time(cost, 0.0)
        return await super().handle(request)


class LoopBlockingServer:
    """Blocks the whole event loop on its first request: a badly written system.

    Requests scheduled during the block are sent late; their latency must still count from their
    scheduled send time. On a loop on virtual time the block is ``loop.advance`` (time passes,
    nothing runs); on a real loop, ``time.sleep``.
    """

    def __init__(self, ctx: SystemContext, block_s: float) -> None:
        self.clock, self.block_s = ctx.clock, block_s

    async def handle(self, request: BenchRequest) -> RequestRecord:
        if request.request_id == 0:
            loop = asyncio.get_running_loop()
            advance = getattr(loop, "advance", None)
            (advance or time.sleep)(self.block_s)
        now = self.clock.now_s()
        return RequestRecord(request.request_id, request.user_id, request.send_s, now, now,
                             "full", 0, len(request.recent_items), request.num_candidates, 0, None)


class HoldingServer:
    """Answers every request after ``hold_s`` of real time (concurrently); may fail some."""

    def __init__(self, ctx: SystemContext, hold_s: float,
                 fail: Callable[[int], bool] = lambda _: False) -> None:
        self.clock, self.hold_s, self.fail = ctx.clock, hold_s, fail
        self.calls: list[int] = []

    async def handle(self, request: BenchRequest) -> RequestRecord:
        self.calls.append(request.request_id)
        await asyncio.sleep(self.hold_s)
        if self.fail(request.request_id):
            raise RuntimeError("instance overloaded")
        now = self.clock.now_s()
        return RequestRecord(request.request_id, request.user_id, request.send_s, now, now,
                             "full", 0, len(request.recent_items), request.num_candidates, 0, None)


def lindley_p99_ms(workload: Workload, warmup: int, service_s: Callable[[int], float]) -> float:
    """Nearest-rank ranking P99 (ms) of a FIFO server over the measured requests, offline."""
    measured = lindley_latencies_ms(workload, warmup, service_s)
    return float(np.percentile(measured, 99, method="inverted_cdf"))


def lindley_latencies_ms(workload: Workload, warmup: int,
                         service_s: Callable[[int], float]) -> np.ndarray:
    """Ranking latency (ms) of each measured request of a FIFO server, offline."""
    prefix = workload.prefix_tokens_at_visit()
    delay = workload.stage_delays.total_s
    free_at, latencies = 0.0, []
    for request, tokens in zip(workload.requests, prefix.tolist(), strict=True):
        due = request.send_s + delay
        free_at = max(due, free_at) + service_s(tokens)
        latencies.append(free_at - due)
    return np.array(latencies[warmup:]) * 1e3


def requests_at(send_s: list[float], num_candidates: int = 4) -> tuple[BenchRequest, ...]:
    """Hand-made requests (user = id, one recent item) at the given send times."""
    return tuple(BenchRequest(i, i + 1, t, (1,), None, None, num_candidates)
                 for i, t in enumerate(send_s))


def tiny_workload(send_s: list[float], prefix_tokens: int = 10) -> Workload:
    """A hand-made workload: request i is user i + 1 with a ``prefix_tokens`` history."""
    from relaygr.bench.workload import StageDelays, WorkloadHistory

    requests = requests_at(send_s)
    histories = {r.user_id: WorkloadHistory(np.ones(prefix_tokens, dtype=np.int64), None)
                 for r in requests}
    return Workload("tiny", 10, histories, requests, StageDelays(0.0, 0.0), qps=0.0, seed=0)
