"""The supervisor restarts dead instances with back-off and gives up loudly (virtual time)."""

from __future__ import annotations

import asyncio

from relaygr.cascade.supervisor import InstanceSupervisor, SupervisorPolicy
from relaygr.engine.scheduler import InstanceStoppedError
from tests.virtual_time import run_virtual


class FakeInstance:
    """Down from the start; each revive fails until ``fails`` are spent, then succeeds."""

    def __init__(self, name: str, fails: int) -> None:
        self.name, self.fails = name, fails
        self.down = True
        self.revived_at: list[float] = []

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
