"""The supervisor restarts dead instances with back-off and gives up loudly, and kills and
restarts hung ones within a second (virtual time)."""

from __future__ import annotations

import asyncio
import contextlib

from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.transport.liveness import HostLiveness, LivenessPolicy
from relaygr.engine.transport.supervisor import InstanceSupervisor, SupervisorPolicy
from tests.virtual_time import run_virtual


class FakeInstance:
    """Down from the start; each revive fails until ``fails`` are spent, then succeeds."""

    def __init__(self, name: str, fails: int) -> None:
        self.name, self.fails = name, fails
        self.down = True
        self.revived_at: list[float] = []

    def hang(self, policy: LivenessPolicy) -> str | None:
        return None                     # dead, never hung

    def kill(self) -> None:
        raise AssertionError("a dead instance is not killed")

    async def revive(self) -> None:
        self.revived_at.append(asyncio.get_running_loop().time())
        if self.fails:
            self.fails -= 1
            raise InstanceStoppedError(f"{self.name} failed to start")
        self.down = False


POLICY = SupervisorPolicy(interval_s=0.2, backoff_s=0.5, max_backoff_s=1.0, max_restarts=3)


def test_restarts_back_off_and_a_flapping_instance_is_given_up() -> None:
    healing, hopeless = FakeInstance("rank-0", fails=2), FakeInstance("rank-1", fails=99)
    supervisor = InstanceSupervisor([healing, hopeless, object()], POLICY)

    async def main() -> None:
        supervisor.start()
        await asyncio.sleep(30)
        await supervisor.stop()

    run_virtual(main())
    assert len(supervisor.watched) == 2          # what cannot be revived is not watched
    assert not healing.down and len(healing.revived_at) == 3
    # tries: at once, then after 0.5 s and 1.0 s (doubling, capped) of back-off
    gaps = [b - a for a, b in zip(healing.revived_at, healing.revived_at[1:], strict=False)]
    assert all(gap >= wait for gap, wait in zip(gaps, (0.5, 1.0), strict=True))
    assert hopeless.down and len(hopeless.revived_at) == 3    # then left alone
    counts = supervisor.counts
    assert (counts.deaths, counts.restarts, counts.failed_restarts) == (2, 1, 5)
    assert counts.given_up == ["rank-1"]


class BeatingInstance:
    """A live instance whose host writes a frame every 0.25 s (as a real host pushes snapshots)
    until ``stop_at`` (as if SIGSTOPped); ``kill`` ends it, and ``revive`` takes a 2 s process
    start and gives it a fresh host that beats."""

    START_S = 2.0

    def __init__(self, name: str, stop_at: float | None = None) -> None:
        self.name, self.stop_at = name, stop_at
        self.down = False
        self.liveness = HostLiveness(0.0)
        self.killed_at: list[float] = []
        self.revived_at: list[float] = []
        self._beats: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._beats = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        while self.stop_at is None or loop.time() < self.stop_at:
            self.liveness.heard(loop.time())
            await asyncio.sleep(0.25)

    def hang(self, policy: LivenessPolicy) -> str | None:
        return None if self.down else self.liveness.check(
            asyncio.get_running_loop().time(), policy)

    def kill(self) -> None:
        assert not self.down and self._beats is not None
        self.killed_at.append(asyncio.get_running_loop().time())
        self._beats.cancel()
        self.down = True

    async def close(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats

    async def revive(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self.START_S)
        self.revived_at.append(loop.time())
        self.liveness, self.stop_at, self.down = HostLiveness(loop.time()), None, False
        self.start()


def _watch(instances: list[BeatingInstance], seconds: float,
           stall_at: float | None = None) -> InstanceSupervisor:
    """Supervise ``instances`` for ``seconds`` of virtual time; at ``stall_at`` the parent's own
    loop is blocked for 2 s (the hosts' frames wait unread meanwhile)."""
    supervisor = InstanceSupervisor(instances, POLICY)

    async def stall() -> None:
        assert stall_at is not None
        await asyncio.sleep(stall_at)
        asyncio.get_running_loop().advance(2.0)     # type: ignore[attr-defined]

    async def main() -> None:
        for inst in instances:
            inst.start()
        supervisor.start()
        stalls = None if stall_at is None else asyncio.create_task(stall())
        await asyncio.sleep(seconds)
        await supervisor.stop()
        if stalls is not None:
            await stalls
        for inst in instances:
            await inst.close()

    run_virtual(main())
    return supervisor


def test_a_hung_instance_is_killed_within_a_second_and_restarted() -> None:
    healthy = BeatingInstance("rank-0")
    first, second = BeatingInstance("rank-1", stop_at=3.0), BeatingInstance("rank-2", 3.5)
    supervisor = _watch([healthy, first, second], 20.0)
    last_frame = 2.75                       # beats at 0, 0.25, ..., 2.75; none at 3.0
    assert len(first.killed_at) == 1 and 0 < first.killed_at[0] - last_frame <= 1.0 + 1e-9
    # the second is judged while the first one's restart waits for its process to start
    assert len(second.killed_at) == 1 and second.killed_at[0] - 3.25 <= 1.0 + 1e-9
    assert second.killed_at[0] < first.killed_at[0] + BeatingInstance.START_S
    for inst in (first, second):            # restarted once, at once (no back-off: 1st try)
        assert len(inst.revived_at) == 1 and not inst.down
        assert inst.revived_at[0] - inst.killed_at[0] <= POLICY.interval_s + 2.0 + 1e-9
    assert not healthy.killed_at and not healthy.revived_at
    counts = supervisor.counts
    assert (counts.hangs, counts.deaths, counts.restarts, counts.failed_restarts) == (2, 0, 2, 0)


def test_a_parent_that_stalls_does_not_kill_healthy_instances() -> None:
    instances = [BeatingInstance("rank-0"), BeatingInstance("rank-1")]
    supervisor = _watch(instances, 10.0, stall_at=4.1)
    assert all(not inst.killed_at for inst in instances)
    assert supervisor.counts.hangs == 0
