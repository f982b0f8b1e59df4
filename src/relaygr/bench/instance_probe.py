"""The baseline's cost curve where it serves: full passes timed in processes set up as its
instances are, all of them computing at once.

``ModelLimitProbe`` times a pass in the benchmark's own process, alone. The baseline serves
elsewhere: each ranking instance is a process of its own
(``relaygr.engine.transport.processes``) with the host allocator tuned and ``threads`` torch
threads, computing on its worker thread under
inference mode (``relaygr.engine.executor``), and near its throughput every instance computes at
the same time, on the same cores. ``InstanceCostProbe`` reproduces that: a ``Layout``
(``instances`` processes of ``threads`` threads each) is a group of probe processes built the
way an instance host builds itself; a timing call has every process of the group run the same
full pass ``repeats`` times, each pass started together with the others' (a barrier before
each), and timed as the instance's scheduler times a batch (the worker's seconds, queueing
excluded). The answer is the median over all processes' passes.

It is a ``relaygr.bench.operating.LayoutProbe``: ``full_rank_ms`` (a median) and
``full_rank_samples_ms`` (every pass, for the cost curve's quantile) time on the layout the modes
serve on (``layout``), ``layout_rank_ms`` on any other (the search over threads per instance).
It is also the physical limit's ``LimitProbe``: ``cached_rank_samples_ms`` times a cached pass in
one such process computing alone, where the relay's low-load requests compute, and as they arrive
(each timed pass after ``limit_pace_s`` of idling, ``relaygr.bench.limit.LIMIT_PACE_S``).
Processes are spawned per layout on first use (a few seconds each: interpreter, torch, the
model's weights) and ended by ``close``; a probe process that does not answer within
``timeout_s`` is a ``BenchProtocolError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import Any

import torch

from relaygr.bench.layout import Layout
from relaygr.bench.limit import LIMIT_PACE_S, ModelLimitProbe
from relaygr.engine.executor import ComputeExecutor
from relaygr.engine.hostmem import tune_host_allocator
from relaygr.errors import BenchProtocolError, ConfigError
from relaygr.model import HSTU, HSTUConfig


@dataclass(frozen=True)
class _Weights:
    """What a probe process needs to rebuild the parent's model (CPU tensors)."""

    config: HSTUConfig
    dtype: str
    state: dict[str, torch.Tensor]

    @classmethod
    def of(cls, model: HSTU) -> _Weights:
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        return cls(model.cfg, str(model.dtype).removeprefix("torch."), state)

    def build(self) -> HSTU:
        model = HSTU(self.config).to(dtype=getattr(torch, self.dtype))
        model.load_state_dict(self.state)
        return model.eval()


def _probe_main(conn: Connection, weights: _Weights, threads: int, barrier: Barrier,
                seed: int) -> None:
    """A probe process: set up as an instance host is, then time passes on request."""
    tune_host_allocator()
    torch.set_num_threads(threads)
    inputs = ModelLimitProbe(weights.build(), seed=seed)
    executor = ComputeExecutor("probe", torch.device("cpu"))
    # the threads the worker computes on, as the parent's check of the set-up
    conn.send(asyncio.run(executor.run(torch.get_num_threads)))
    while (call := conn.recv()) is not None:
        kind, prefix, suffix, candidates, batch, repeats, warmup, pace_s = call
        if kind == "cached":
            timed = inputs.cached_pass(prefix, suffix, candidates)
        else:
            requests = inputs.full_pass_inputs(prefix, suffix, candidates, batch)
            timed = partial(inputs.model.rank_batch_outputs, requests)
        conn.send(asyncio.run(_passes(executor, timed, barrier, repeats, warmup, pace_s)))
    executor.shutdown()


async def _passes(executor: ComputeExecutor, call: Callable[[], object],
                  barrier: threading.Barrier, repeats: int, warmup: int,
                  pace_s: float = 0.0) -> list[float]:
    """ms of each of ``repeats`` calls after ``warmup``, each started with the other
    instances' (the worker's compute seconds, as the instance's scheduler times a batch), each
    timed call after ``pace_s`` of idling."""
    ms = []
    for i in range(warmup + repeats):
        if i >= warmup and pace_s > 0:
            await asyncio.sleep(pace_s)
        barrier.wait()
        _, seconds = await executor.run_timed(call)
        if i >= warmup:
            ms.append(seconds * 1e3)
    return ms


class _Group:
    """The probe processes of one layout."""

    def __init__(self, layout: Layout, weights: _Weights, seed: int, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.layout, self.timeout_s = layout, timeout_s
        barrier = ctx.Barrier(layout.instances)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(layout.instances):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_probe_main, daemon=True,
                               args=(child, weights, layout.threads, barrier, seed + i))
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.worker_threads = [int(self._recv(conn)) for conn in self.conns]

    def _recv(self, conn: Connection) -> Any:
        if not conn.poll(self.timeout_s):
            raise BenchProtocolError(f"a cost probe process ({self.layout}) did not answer "
                                     f"within {self.timeout_s:g} s")
        return conn.recv()

    def time(self, call: tuple[str | int | float, ...]) -> list[float]:
        for conn in self.conns:
            conn.send(call)
        return [ms for conn in self.conns for ms in self._recv(conn)]

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            with contextlib.suppress(OSError):      # it has ended already
                conn.send(None)
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.terminate()


class InstanceCostProbe:
    """Times full passes in processes set up as the baseline's instances (module docstring)."""

    def __init__(self, model: HSTU, layout: Layout, repeats: int = 9, warmup: int = 2,
                 seed: int = 0, timeout_s: float = 120.0,
                 limit_pace_s: float = LIMIT_PACE_S) -> None:
        """``limit_pace_s``: the idling before each of ``cached_rank_samples_ms``'s passes
        (``relaygr.bench.limit``)."""
        if model.device.type != "cpu":
            raise ConfigError("InstanceCostProbe times CPU instances (a GPU instance is a "
                              "worker thread of the serving process: time it there)")
        if repeats < 1 or warmup < 0 or limit_pace_s < 0:
            raise ConfigError("InstanceCostProbe needs repeats >= 1 and warmup, "
                              "limit_pace_s >= 0")
        self.layout, self.repeats, self.warmup = layout, repeats, warmup
        self.limit_pace_s = limit_pace_s
        self.seed, self.timeout_s = seed, timeout_s
        self._weights = _Weights.of(model)
        self._groups: dict[Layout, _Group] = {}

    def _group(self, layout: Layout) -> _Group:
        if layout not in self._groups:
            self._groups[layout] = _Group(layout, self._weights, self.seed, self.timeout_s)
        return self._groups[layout]

    def layout_rank_ms(self, layout: Layout, prefix_tokens: int, suffix_tokens: int,
                       candidates: int, batch: int = 1) -> float:
        """Median ms of one instance's model call of ``batch`` full passes, with every
        instance of ``layout`` computing the same at once."""
        call = ("full", prefix_tokens, suffix_tokens, candidates, batch, self.repeats,
                self.warmup, 0.0)
        return statistics.median(self._group(layout).time(call))

    def cached_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                               passes: int) -> list[float]:
        """Ms of each of ``passes`` timed cached ranking passes in one instance-like process
        computing alone (a ``LimitProbe``: the relay's low-load latency is set against it, so
        the overhead counts the relay's own cost, not the difference between this process and
        an instance's, nor a warm pass against a cold one: each timed pass follows
        ``limit_pace_s`` of idling, as a low-load request does). The prefix K/V is computed
        first, outside the timed calls."""
        call = ("cached", prefix_tokens, suffix_tokens, candidates, 1, passes,
                self.warmup, self.limit_pace_s)
        return list(self._group(Layout(1, self.layout.threads)).time(call))

    def full_rank_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                     batch: int = 1) -> float:
        return self.layout_rank_ms(self.layout, prefix_tokens, suffix_tokens, candidates, batch)

    def full_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                             passes: int) -> list[float]:
        """Ms of each of at least ``passes`` single-user full passes on the serving layout,
        every instance computing at once: each process times its share of them."""
        each = -(-passes // self.layout.instances)
        call = ("full", prefix_tokens, suffix_tokens, candidates, 1, each, self.warmup, 0.0)
        return list(self._group(self.layout).time(call))

    def close(self) -> None:
        """End every probe process (idempotent)."""
        for group in self._groups.values():
            group.close()
        self._groups.clear()
