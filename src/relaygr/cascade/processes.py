"""Ranking instances in processes of their own: one interpreter, so one GIL, per instance.

Why: in one process the instances' worker threads share a GIL, and a ranking pass spends much
of its time in Python between the ops (the model's per-layer code, the scheduler, the cache
bookkeeping). On the 2-core CPU box a cached ranking pass (cpu profile, 512-token prefix,
256 candidates) took 5.2-6.7 ms alone, 7.5-9.9 ms each when two threads of one process ran it
at once, and 5.1-7.7 ms each in two processes
(docs/runs/2026-11-21-bench-what-limits-the-relay-s-throughput-taken-apart.md). A production
ranking server runs one process per accelerator for the same
reason.

``InstanceProcesses`` starts K host processes once (spawned: model weights and the fitted cost
model are sent over once, and the weights' digest is checked there) and hands out
``ProcessInstance`` handles through ``factory``, the ``InstanceFactory`` that ``RelaySystem``
takes. Each handle's instance is today's ``RankingInstance``, built by ``build_instance`` in
the host process from the system's config, so trigger, scheduler, device pool and host tier
run there unchanged; a host can carry several instances (of different systems) at once, and a
system's ``stop`` drops its instances from their hosts, so every benchmark point still starts
from empty caches without paying a process start.

The host side (framing, serving loop) is ``relaygr.cascade.instance_host``; the messages are the
cascade's one set (``cascade.messages``, the Ray replicas' too), pickled frames over a socket
pair, each side driven by its own event loop:

* ``preinfer`` is sent and answered later (the handle returns an awaitable); the ranking leg
  may be sent right after it, because a host reads one instance's messages in order and starts
  each ranking request only after the signals read before it;
* ``rank`` carries the prefix as events (``PrefixPayload``: the host rebuilds ``version_at``
  with the store's hash and checks the version), the candidates and the suffix, and comes back
  with the scores (bit-exact: the model's dtype travels with them) and the path;
* the host pushes each instance's ``InstanceSnapshot`` every ``push_interval_s`` while it
  serves, and with every control reply, so ``snapshot()`` stays synchronous and cheap
  (``refresh()`` asks for one now).

Failure model: a host that dies (or is killed) fails every call in flight and every later one
with ``InstanceStoppedError``, so the cascade fails over to the user's next choice exactly as
for a failed in-process instance; its handles are then ``down``, and ``revive`` (what
``cascade.supervisor`` calls) opens them on a fresh host. A host that is alive but does not
answer is seen by ``hang`` (``cascade.liveness``) and ended by ``kill``: its calls in flight
fail over at once and it is then down like one that died. ``fail``/``restart`` go to the
instance in the host. The parent's end of a host is ``cascade.host_link.HostLink``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import weakref
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.host_link import HostLink
from relaygr.cascade.instance_host import HostSpec
from relaygr.cascade.instances import InstanceFactory
from relaygr.cascade.liveness import LivenessPolicy
from relaygr.cascade.messages import (
    ControlCall,
    Open,
    PreinferCall,
    PreinferReply,
    RankCall,
    RankReply,
    Reply,
)
from relaygr.cascade.payload import PrefixPayload
from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.snapshot import InstanceSnapshot
from relaygr.engine.types import PrefixSpec, PreinferAction, PreinferResult, RankJob, RankResult
from relaygr.errors import ConfigError
from relaygr.model import HSTU
from relaygr.model.digest import model_digest
from relaygr.relay.costmodel import LatencyCostModel

PLACEMENTS = ("auto", "on", "off")


def wants_processes(placement: str, device: str) -> bool:
    """Whether instances run in processes of their own for a ``--instance-processes`` choice:
    ``auto`` is on for CPU (instances on threads of one process contend for its interpreter
    lock) and off for CUDA (each instance a worker thread and stream; processes there are not
    validated yet)."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"instance placement must be one of {PLACEMENTS}, got {placement!r}")
    return placement == "on" or (placement == "auto" and torch.device(device).type == "cpu")


def threads_per_instance(num_instances: int) -> int:
    """One core's share per instance, so instances compute in parallel without oversubscribing."""
    return max(1, (os.cpu_count() or 1) // num_instances)


class ProcessInstance:
    """The parent's handle for one instance in a host process (``InstanceHandle``).

    ``rank_queue_depth`` counts the ranking requests sent and not yet answered (the one being
    computed included), which is what the parent can know without asking; ``queue_depth`` adds
    the host's last reported pre-infer queue.
    """

    def __init__(self, link: HostLink, iid: int, config: SystemConfig, name: str,
                 device: str) -> None:
        self.link = link
        self.iid = iid
        self.config = config
        self._name = name
        self.device = device
        self._up = False
        self._ranks = 0
        self.last = InstanceSnapshot(name, False, 0, 0, None, None)   # pushed or replied

    @property
    def name(self) -> str:
        return self._name

    @property
    def healthy(self) -> bool:
        return self._up and self.link.alive

    @property
    def rank_queue_depth(self) -> int:
        return self._ranks

    @property
    def queue_depth(self) -> int:
        return self._ranks + self.last.prefill_queue_depth   # read per request: no copy

    def snapshot(self) -> InstanceSnapshot:
        """The host's last report, with health as the parent sees it now (a host that died
        cannot report its own death)."""
        return replace(self.last, healthy=self.healthy)

    @property
    def down(self) -> bool:
        """Started (and not failed on purpose) but its process is gone: ``revive`` it."""
        return self._up and not self.link.alive

    def hang(self, policy: LivenessPolicy) -> str | None:
        """Why its host counts as hung (``cascade.liveness``), or None (always, when not up)."""
        return self.link.hang(policy) if self._up else None

    def kill(self) -> None:
        """End its host (and every instance it carries): the instance is then ``down``."""
        self.link.kill()

    async def revive(self) -> None:
        """Open this instance again on a fresh host process (its caches start empty)."""
        await self.link.respawn()
        await self._open()

    async def _open(self) -> None:
        self._value(await self.link.call(Open(iid=self.iid, config=self.config,
                                              name=self._name, device=self.device)))
        self.link.handles[self.iid] = self

    def _value(self, reply: Reply) -> Any:
        if reply.snapshot is not None:
            self.last = reply.snapshot
        if reply.error is not None:
            raise reply.error
        return reply.value

    async def _control(self, op: str) -> Any:
        return self._value(await self.link.call(ControlCall(iid=self.iid, op=op)))

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.link.ensure_started()
        await self._open()
        self._up = True

    async def stop(self) -> None:
        was_up, self._up = self._up, False
        if was_up and self.link.alive:
            try:
                final = await self._control("stop")
            except InstanceStoppedError:
                final = None            # the process ended first: the instance is gone with it
            if isinstance(final, InstanceSnapshot):
                self.last = final
        self.link.handles.pop(self.iid, None)

    async def fail(self) -> None:
        self._up = False
        await self._control("fail")

    async def restart(self) -> None:
        await self._control("restart")
        self._up = True

    async def idle(self) -> None:
        if self.link.alive and self._up:
            await self._control("idle")

    async def check_integrity(self) -> None:
        if self.link.alive and self._up:
            await self._control("integrity")

    async def refresh(self) -> InstanceSnapshot:
        """Ask the host for this instance's snapshot now (``snapshot()`` is the last received)."""
        if self.link.alive and self._up:
            await self._control("snapshot")
        return self.snapshot()

    # ---- the two legs ------------------------------------------------------------------------
    def preinfer(self, spec: PrefixSpec, suffix_tokens: int, candidates: int
                 ) -> Awaitable[PreinferResult]:
        """Sends the signal now; the task resolves with the host's decision (a host that went
        down meanwhile counts as skipped: the ranking leg then fails over and recomputes)."""
        loop = asyncio.get_running_loop()
        if not self.healthy:
            done: asyncio.Future[PreinferResult] = loop.create_future()
            done.set_result(PreinferResult(PreinferAction.SKIPPED, None, 0))
            return done
        sent = self.link.call(PreinferCall(iid=self.iid, prefix=PrefixPayload.of(spec),
                                           suffix_tokens=suffix_tokens, candidates=candidates))
        return loop.create_task(self._preinfer_result(sent))

    async def _preinfer_result(self, sent: asyncio.Future[Reply]) -> PreinferResult:
        try:
            reply = self._value(await sent)
        except InstanceStoppedError:
            return PreinferResult(PreinferAction.SKIPPED, None, 0)
        assert isinstance(reply, PreinferReply)
        return reply.result

    async def rank(self, job: RankJob) -> RankResult:
        if not self.healthy:
            raise InstanceStoppedError(f"{self._name} is down")
        self._ranks += 1
        sent = time.perf_counter()
        try:
            ranked = self._value(await self.link.call(RankCall.of(job, iid=self.iid)))
        finally:
            self._ranks -= 1
        assert isinstance(ranked, RankReply) and ranked.path is not None
        timing = ranked.timing
        if timing is not None:   # the hop both ways, pickling included
            timing = replace(timing, transport_s=max(
                0.0, time.perf_counter() - sent - timing.total_s))
        return RankResult(ranked.tensor(), ranked.path, self._name, timing)


@dataclass
class InstanceProcesses:
    """K host processes for ranking instances (see the module docstring).

    ``factory`` places each instance name on a host, the first K names in turn and then round
    robin, so ``rank-i`` of every system lands on the same host. The processes start with the
    first instance started on them (inside the serving event loop), or all at once with
    ``start``; ``close`` ends them (they are daemons, so the interpreter's exit also does).
    """

    spec: HostSpec
    num_processes: int
    start_timeout_s: float = 120.0
    _links: list[HostLink] = field(default_factory=list, init=False, repr=False)
    _by_name: dict[str, HostLink] = field(default_factory=dict, init=False, repr=False)
    _iids: itertools.count[int] = field(default_factory=lambda: itertools.count(1),
                                       init=False, repr=False)
    _checked: weakref.WeakSet[HSTU] = field(default_factory=weakref.WeakSet, init=False,
                                            repr=False)   # models whose digest matched
    # (checked once per model object: one whose weights change in place needs new processes)

    def __post_init__(self) -> None:
        if self.num_processes <= 0:
            raise ConfigError("InstanceProcesses needs at least one process")
        self._links = [HostLink(i, self.spec, self.start_timeout_s)
                       for i in range(self.num_processes)]

    @classmethod
    def for_model(cls, model: HSTU, cost_model: LatencyCostModel, num_processes: int,
                  torch_threads: int | None = 1) -> InstanceProcesses:
        return cls(HostSpec.of(model, cost_model, torch_threads), num_processes)

    @property
    def factory(self) -> InstanceFactory:
        def make(config: SystemConfig, name: str, device: str, model: HSTU,
                 cost_model: LatencyCostModel) -> ProcessInstance:
            if model not in self._checked:
                if model_digest(model) != self.spec.digest:
                    raise ConfigError("these instance processes serve a different model")
                self._checked.add(model)
            link = self._by_name.get(name)
            if link is None:
                link = self._by_name[name] = self._links[len(self._by_name) % len(self._links)]
            return ProcessInstance(link, next(self._iids), config, name, device)
        return make

    async def start(self) -> None:
        """Start every process now (otherwise each starts with its first instance)."""
        await asyncio.gather(*(link.ensure_started() for link in self._links))

    def pids(self) -> list[int | None]:
        return [None if link.process is None else link.process.pid for link in self._links]

    def close(self) -> None:
        for link in self._links:
            link.terminate()


__all__ = ["PLACEMENTS", "HostSpec", "InstanceProcesses", "ProcessInstance",
           "threads_per_instance", "wants_processes"]
