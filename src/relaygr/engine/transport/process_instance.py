"""The parent's handle for one ranking instance in a host process (``engine.transport.processes``).

``ProcessInstance`` is an ``InstanceHandle``: it sends the two legs and the lifecycle calls as
the transport's messages (``engine.transport.messages``) over its host's ``HostLink`` and turns
the replies back into results, so the cascade drives it exactly as an in-process
``RankingInstance``. ``config`` is the system's config, opaque here: the host hands it to its
builder. Health is what the parent sees (a host that died cannot report its own death), and a
host that is down is ``revive``d by ``engine.transport.supervisor``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.snapshot import InstanceSnapshot
from relaygr.engine.transport.host_link import HostLink
from relaygr.engine.transport.liveness import LivenessPolicy
from relaygr.engine.transport.messages import (
    AbandonCall,
    ControlCall,
    Open,
    PreinferCall,
    PreinferReply,
    RankCall,
    RankReply,
    Reply,
)
from relaygr.engine.transport.payload import PrefixPayload
from relaygr.engine.types import PrefixSpec, PreinferAction, PreinferResult, RankJob, RankResult
from relaygr.kvcache import PrefixId

log = logging.getLogger("relaygr.engine.transport")
# How long a host may take to answer an instance's stop (the instance fails its queued work and
# ends its running pass) before it is killed: a hung host must not hold a shutdown for ever.
STOP_TIMEOUT_S = 10.0


class ProcessInstance:
    """The parent's handle for one instance in a host process (``InstanceHandle``).

    ``rank_queue_depth`` counts the ranking requests sent and not yet answered (the one being
    computed included), which is what the parent can know without asking.
    """

    def __init__(self, link: HostLink, iid: int, config: Any, name: str,
                 device: str) -> None:
        self.link = link
        self.iid = iid
        self.config = config
        self._name = name
        self.device = device
        self._up = False
        self._open_on_host = False      # Open answered by the current host process
        self._ranks = 0
        self.last = InstanceSnapshot(name, False, 0, 0, None, None)   # pushed or replied

    @property
    def name(self) -> str:
        return self._name

    @property
    def healthy(self) -> bool:
        return self._up and self._open_on_host and self.link.alive

    @property
    def rank_queue_depth(self) -> int:
        return self._ranks

    def snapshot(self) -> InstanceSnapshot:
        """The host's last report, with health as the parent sees it now (a host that died
        cannot report its own death)."""
        return replace(self.last, healthy=self.healthy)

    @property
    def down(self) -> bool:
        """Started (and not failed on purpose) but its process is gone: ``revive`` it."""
        return self._up and not self.link.alive

    def hang(self, policy: LivenessPolicy) -> str | None:
        """Why its host counts as hung (``engine.transport.liveness``): silent, or this
        instance stuck in a ranking call; or None (always, when not up). Another instance's
        stuck call on the same host is that instance's to report, though killing the host
        ends this one too."""
        return self.link.hang(policy, self.iid) if self._up else None

    def kill(self) -> None:
        """End its host (and every instance it carries): the instance is then ``down``."""
        self.link.kill()

    async def revive(self) -> None:
        """Open this instance again on a fresh host process (its caches start empty). Not
        healthy until the host has opened it; where the host cannot (the instance's build
        raised), the host is ended, so the instance is down again and the supervisor's next
        try (with its back-off and give-up) starts over."""
        self._open_on_host = False
        await self.link.respawn()
        try:
            await self._open()
        except BaseException:
            self.link.kill()
            raise

    async def _open(self) -> None:
        self._value(await self.link.call(Open(iid=self.iid, config=self.config,
                                              name=self._name, device=self.device)))
        self.link.handles[self.iid] = self
        self._open_on_host = True

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
        """Stop the instance on its host; a host that does not answer within
        ``STOP_TIMEOUT_S`` (stopped, or stuck) is killed, so that a stop always ends."""
        was_up, self._up = self._up, False
        if was_up and self.link.alive:
            try:
                final = await asyncio.wait_for(self._control("stop"), STOP_TIMEOUT_S)
            except InstanceStoppedError:
                final = None            # the process ended first: the instance is gone with it
            except TimeoutError:
                log.warning("instance %s did not answer its stop within %g s: killing its "
                            "process", self._name, STOP_TIMEOUT_S)
                self.link.kill()
                final = None
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

    def abandon(self, pid: PrefixId) -> Awaitable[bool]:
        """Sends it now (``RankingInstance.abandon`` in the host); the task resolves with whether
        anything changed there (False when this instance is down or went down meanwhile)."""
        loop = asyncio.get_running_loop()
        if not self.healthy:
            done: asyncio.Future[bool] = loop.create_future()
            done.set_result(False)
            return done
        return loop.create_task(self._abandoned(self.link.call(AbandonCall(iid=self.iid,
                                                                           pid=pid))))

    async def _abandoned(self, sent: asyncio.Future[Reply]) -> bool:
        try:
            return bool(self._value(await sent))
        except InstanceStoppedError:
            return False

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
