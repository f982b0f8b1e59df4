"""Admission at the server's door: an in-flight cap, draining, and per-user ordering.

``Admission`` counts requests in flight, in all and per user. Past ``max_in_flight``, past
``max_in_flight_per_user`` of one user (so that one client retrying in a loop, whose requests
queue behind each other on its ``UserLocks`` lock, cannot take every slot from the others), or
once draining has begun, a new request is refused with ``OverloadedError`` (HTTP 503 +
Retry-After) before any work;
``drain()`` waits for the ones already admitted to finish. Each refusal is counted by its
``DoorRefusal`` reason (``relaygr_door_refusals_total{reason}``), so a 503 at the door is told
apart from a shed ranking leg, no healthy instance or the history store out of reach.
``UserLocks`` serialises the requests of one user, so the history a request was validated
against is the one it is served from (an event append cannot slip in between) and a visit's
events are appended in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from enum import Enum

from relaygr.errors import OverloadedError


class DoorRefusal(str, Enum):
    """Why ``Admission`` refused a request (the metric's ``reason`` label: a fixed set)."""

    DRAINING = "draining"                  # shutdown has begun
    IN_FLIGHT_LIMIT = "in_flight_limit"    # ``max_in_flight`` requests already admitted
    USER_LIMIT = "user_in_flight_limit"    # ``max_in_flight_per_user`` of this user admitted


class Admission:
    """In-flight accounting. One event loop drives it."""

    def __init__(self, max_in_flight: int, retry_after_s: float,
                 max_in_flight_per_user: int | None = None) -> None:
        self.max_in_flight = max_in_flight
        self.max_in_flight_per_user = max_in_flight_per_user or max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.users: dict[int, int] = {}     # user -> its requests in flight (entries > 0 only)
        self.refusals = dict.fromkeys(DoorRefusal, 0)
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @asynccontextmanager
    async def admit(self, user_id: int | None = None) -> AsyncIterator[None]:
        """Hold one in-flight slot (and one of ``user_id``'s, when given) for the block."""
        if self.draining:
            self.refusals[DoorRefusal.DRAINING] += 1
            raise OverloadedError("the server is shutting down", self.retry_after_s)
        if self.in_flight >= self.max_in_flight:
            self.refusals[DoorRefusal.IN_FLIGHT_LIMIT] += 1
            raise OverloadedError(f"{self.in_flight} requests in flight (the limit)",
                                  self.retry_after_s)
        held = 0 if user_id is None else self.users.get(user_id, 0)
        if held >= self.max_in_flight_per_user:
            self.refusals[DoorRefusal.USER_LIMIT] += 1
            raise OverloadedError(f"{held} requests of user {user_id} in flight (the per-user "
                                  "limit)", self.retry_after_s)
        self.in_flight += 1
        if user_id is not None:
            self.users[user_id] = held + 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if user_id is not None:
                left = self.users[user_id] - 1
                if left:
                    self.users[user_id] = left
                else:
                    del self.users[user_id]
            if self.in_flight == 0:
                self._idle.set()

    @property
    def refused(self) -> int:
        """Requests refused at the door, for every reason."""
        return sum(self.refusals.values())

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait for admitted ones; False if some outlived the timeout."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


class UserLocks:
    """One lock per user with requests in flight (entries go when their last holder leaves)."""

    def __init__(self) -> None:
        self._locks: dict[int, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, user_id: int) -> AsyncIterator[None]:
        lock, holders = self._locks.get(user_id, (asyncio.Lock(), 0))
        self._locks[user_id] = (lock, holders + 1)
        try:
            async with lock:
                yield
        finally:
            lock, holders = self._locks[user_id]
            if holders == 1:
                del self._locks[user_id]
            else:
                self._locks[user_id] = (lock, holders - 1)

    def __len__(self) -> int:
        return len(self._locks)
