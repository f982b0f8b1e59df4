"""Ranking instances in processes of their own: one interpreter, so one GIL, per instance.

Why: in one process the instances' worker threads share a GIL, and a ranking pass spends much
of its time in Python between the ops (the model's per-layer code, the scheduler, the cache
bookkeeping). On the 2-core CPU box a cached ranking pass (cpu profile, 512-token prefix,
256 candidates) took 5.2-6.7 ms alone, 7.5-9.9 ms each when two threads of one process ran it
at once, and 5.1-7.7 ms each in two processes
(docs/runs/2026-11-21-bench-what-limits-the-relay-s-throughput-taken-apart.md). A production
ranking server runs one process per accelerator for the same
reason.

``InstanceProcesses`` starts K host processes once (spawned: model weights and the fitted cost model
are sent over once, and the weights' digest is checked there) and hands out ``ProcessInstance``
handles through ``factory``, the ``InstanceFactory`` that ``RelaySystem`` takes. Each handle's
instance is today's ``RankingInstance``, built by ``build_instance`` (the cascade's, passed in as
``for_model``'s ``build``) in the host process from the system's config, so trigger, scheduler,
device pool and host tier run there unchanged; a host can carry several instances (of different
systems) at once, and a system's ``stop`` drops its instances from their hosts, so every benchmark
point still starts from empty caches without paying a process start.

The host side (framing, serving loop) is ``relaygr.engine.transport.host``; the messages are the
transports' one set (``engine.transport.messages``, the Ray replicas' too), pickled frames over a
socket pair, each side driven by its own event loop:

* ``preinfer`` is sent and answered later (the handle returns an awaitable); the ranking leg
  may be sent right after it, because a host reads one instance's messages in order and starts
  each ranking request only after the signals read before it;
* ``rank`` carries the prefix as events (``PrefixPayload``: the host rebuilds ``version_at``
  with the store's hash and checks the version), the candidates and the suffix, and comes back
  with the scores (bit-exact: the model's dtype travels with them) and the path;
* the host pushes each instance's ``InstanceSnapshot`` every ``push_interval_s`` while it
  serves, and with every control reply, so ``snapshot()`` stays synchronous and cheap
  (``refresh()`` asks for one now).

Failure model: a host that dies (or is killed) fails every call in flight and every later one with
``InstanceStoppedError``, so the cascade fails over to the user's next choice exactly as for a
failed in-process instance; its handles are then ``down``, and ``revive`` (what
``engine.transport.supervisor`` calls) opens them on a fresh host. A host that is alive but does not
answer is seen by ``hang`` (``engine.transport.liveness``) and ended by ``kill``: its calls in
flight fail over at once and it is then down like one that died. ``fail``/``restart`` go to the
instance in the host. The parent's end of a host is ``engine.transport.host_link.HostLink``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from relaygr.engine.transport.host import HostSpec, InstanceBuilder
from relaygr.engine.transport.host_link import HostLink
from relaygr.engine.transport.process_instance import ProcessInstance
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
                  torch_threads: int | None = 1, *, build: InstanceBuilder
                  ) -> InstanceProcesses:
        """``build``: how a host builds an instance for a system's config (the cascade's
        ``build_instance``)."""
        return cls(HostSpec.of(model, cost_model, build, torch_threads), num_processes)

    @property
    def factory(self) -> Callable[[Any, str, str, HSTU, LatencyCostModel], ProcessInstance]:
        """The ``InstanceFactory`` that ``RelaySystem`` takes (``config``: its system's)."""
        def make(config: Any, name: str, device: str, model: HSTU,
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
