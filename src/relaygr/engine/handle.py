"""What the cascade needs from a ranking instance, wherever the instance runs.

``RankingInstance`` (in this process, driven by this event loop) and ``ProcessInstance`` (the
same instance in a process of its own, ``relaygr.engine.transport.processes``) both satisfy it, so
the cascade's ``InstanceFleet`` routes, sheds and fails over the same way over either.

``preinfer`` is the one leg that differs in shape: in-process it decides at once and returns
the result; across a process boundary the decision comes back later, so it returns an awaitable
(the ranking leg can still be sent right after it: one instance handles its messages in order).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from relaygr.engine.snapshot import InstanceSnapshot
from relaygr.engine.types import PrefixSpec, PreinferResult, RankJob, RankResult
from relaygr.kvcache import PrefixId


class InstanceHandle(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def rank_queue_depth(self) -> int:
        """Ranking requests queued or running: the router's load signal and the shed rules'."""

    def preinfer(self, spec: PrefixSpec, suffix_tokens: int, candidates: int
                 ) -> PreinferResult | Awaitable[PreinferResult]: ...

    def abandon(self, pid: PrefixId) -> bool | Awaitable[bool]:
        """``pid``'s pre-infer signal will see no ranking leg here: free its footprint (in
        another process: sent now, done there later)."""

    async def rank(self, job: RankJob) -> RankResult: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def fail(self) -> None: ...

    async def restart(self) -> None: ...

    async def idle(self) -> None: ...

    async def check_integrity(self) -> None: ...

    def snapshot(self) -> InstanceSnapshot: ...
