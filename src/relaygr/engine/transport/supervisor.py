"""Keeps a system's instance processes alive: a dead or hung one is seen, routed around and
restarted.

An instance whose process exits (killed, crashed, out of memory) stops being healthy at once (the
parent sees its socket close), so the router sends its users to the next instance and the requests
it held fail over (``RelaySystem``). An instance whose process is alive but does not answer
(stopped, or stuck in a call) is judged hung at a check (every ``interval_s``, by the deadlines of
``engine.transport.liveness``: within about a second of its last frame) and killed, which makes it
down the same way: unhealthy at once, its requests in flight failed over. The supervisor then
restarts it on a fresh process, after a back-off that doubles on each failed try, and gives up
loudly after ``max_restarts`` tries in a row: an instance that keeps dying is a fault to look at,
not to hide. Every death (a process that exited by itself), hang (a process killed for not
answering; not counted again as a death), restart and give-up is logged and counted
(``SupervisorCounts``, exported as metrics). An instance failed on purpose (``fail_instance``) is
neither down nor checked, and is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from relaygr.engine.transport.liveness import LivenessPolicy

log = logging.getLogger("relaygr.supervisor")


@runtime_checkable
class Revivable(Protocol):
    """An instance that can lose its process and get a new one (``ProcessInstance``)."""

    @property
    def name(self) -> str: ...

    @property
    def down(self) -> bool: ...

    async def revive(self) -> None: ...

    def hang(self, policy: LivenessPolicy) -> str | None:
        """Why it counts as hung now (its process alive but not answering), or None."""

    def kill(self) -> None:
        """End its process (it is then ``down``)."""


@dataclass(frozen=True)
class SupervisorPolicy:
    # How often instances are looked at: a death is seen within this (and routed around at
    # once, since health is read on every request).
    interval_s: float = 0.2
    # The first restart's wait, doubled after every failed one, up to max_backoff_s.
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    # Failed restarts in a row after which the instance is given up (left down, logged).
    max_restarts: int = 5
    # When a live instance counts as hung (checked every interval_s).
    liveness: LivenessPolicy = field(default_factory=LivenessPolicy)


@dataclass
class SupervisorCounts:
    deaths: int = 0
    hangs: int = 0
    restarts: int = 0
    failed_restarts: int = 0
    given_up: list[str] = field(default_factory=list)


class InstanceSupervisor:
    """See the module docstring. ``start`` inside the serving loop; ``stop`` before the
    instances stop."""

    def __init__(self, instances: Sequence[object], policy: SupervisorPolicy | None = None
                 ) -> None:
        self.watched = [i for i in instances if isinstance(i, Revivable)]
        self.policy = policy or SupervisorPolicy()
        self.counts = SupervisorCounts()
        self._task: asyncio.Task[None] | None = None
        self._tries: dict[str, int] = {}
        self._seen_down: set[str] = set()
        # One restart at a time per instance, each a task of its own, so the checks go on
        # every interval_s while a restart waits out its back-off or a process start.
        self._restarting: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        if self.watched and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._restarting.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        self._restarting.clear()

    async def _watch(self) -> None:
        while True:
            for inst in self.watched:
                if inst.name in self.counts.given_up:
                    continue
                why = inst.hang(self.policy.liveness)
                if why is not None:
                    self._kill(inst, why)
                if inst.down and inst.name not in self._restarting:
                    self._restarting[inst.name] = task = asyncio.create_task(
                        self._restart(inst))
                    task.add_done_callback(self._restart_ended)
            await asyncio.sleep(self.policy.interval_s)

    def _restart_ended(self, task: asyncio.Task[None]) -> None:
        name = next((n for n, t in self._restarting.items() if t is task), None)
        if name is not None:
            del self._restarting[name]
        if not task.cancelled() and task.exception() is not None:
            log.error("instance %s: restart failed unexpectedly", name,
                      exc_info=task.exception())

    def _kill(self, inst: Revivable, why: str) -> None:
        self._seen_down.add(inst.name)      # a hang, not a death
        self.counts.hangs += 1
        log.warning("instance %s is hung (%s): killing its process; its users go to the next "
                    "instance; restarting it", inst.name, why)
        inst.kill()

    async def _restart(self, inst: Revivable) -> None:
        if inst.name not in self._seen_down:
            self._seen_down.add(inst.name)
            self.counts.deaths += 1
            log.warning("instance %s is down (its process exited): its users go to the next "
                        "instance; restarting it", inst.name)
        tries = self._tries.get(inst.name, 0)
        if tries:
            wait = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** (tries - 1))
            await asyncio.sleep(wait)
        try:
            await inst.revive()
        except Exception as exc:   # the process did not start, or the instance's build raised
            self.counts.failed_restarts += 1
            self._tries[inst.name] = tries + 1
            if tries + 1 >= self.policy.max_restarts:
                self.counts.given_up.append(inst.name)
                log.error("instance %s: %d restarts failed in a row, giving up (last: %s)",
                          inst.name, tries + 1, exc)
            else:
                log.warning("instance %s: restart %d failed: %s", inst.name, tries + 1, exc)
            return
        self._tries.pop(inst.name, None)
        self._seen_down.discard(inst.name)
        self.counts.restarts += 1
        log.warning("instance %s restarted on a new process", inst.name)
