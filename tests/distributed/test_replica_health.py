"""A ranking replica's health check (what Ray Serve calls to replace a replica that does not
serve): a stuck ranking instance, a stopped one, a dead scheduler and one whose ranking calls
keep raising (its circuit breaker) are unhealthy; a busy one that answers its queue is not. The
replica's clock is the test's; the compute is held on a gate, so no verdict depends on the
machine's speed."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from relaygr.distributed.app import RayAppSpec, ranking_deployment_options
from relaygr.distributed.health import HealthCheckPolicy, ReplicaUnhealthyError
from relaygr.distributed.replica import RankingReplica
from relaygr.engine.transport.liveness import LivenessPolicy
from relaygr.engine.transport.messages import ControlCall, RankCall, RankReply
from relaygr.engine.transport.payload import PrefixPayload
from relaygr.errors import ConfigError, HistoryStoreUnavailableError, SequenceTooLongError
from relaygr.kvcache import PrefixId
from relaygr.server.config import ServerConfig
from tests.distributed.helpers import replica_spec
from tests.engine.helpers import failing_passes
from tests.server.helpers import SOURCE, system_config

DEADLINE_S = LivenessPolicy().rank_deadline_s
DEVICE_ERROR = RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
BREAKER_OPEN = ("circuit breaker open: 3 ranking calls in a row raised (the last: RuntimeError: "
                "CUDA error: an illegal memory access was encountered (injected))")
OPEN = "^" + re.escape(f"replica r0: {BREAKER_OPEN}") + "$"      # what check_health raises


class Clock:
    """The replica's health clock, moved by the test."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Gate:
    """Holds each ranking batch on the instance's worker thread until the test lets it go."""

    def __init__(self, run_batch: Callable[[list[Any]], list[Any]]) -> None:
        self.run_batch = run_batch
        self._entered = threading.Semaphore(0)
        self._permits = threading.Semaphore(0)

    def __call__(self, payloads: list[Any]) -> list[Any]:
        self._entered.release()
        self._permits.acquire(timeout=60)
        return self.run_batch(payloads)

    async def entered(self) -> None:
        assert await asyncio.to_thread(self._entered.acquire, True, 60), "no batch started"

    def release(self) -> None:
        self._permits.release()


def _replica(**system: object) -> tuple[RankingReplica, Clock]:
    replica = RankingReplica(replica_spec(system_config(**system), "r0", None))
    clock = Clock()
    replica.health.clock = clock
    return replica, clock


def _gate(replica: RankingReplica) -> Gate:
    scheduler = replica.instance.scheduler
    gate = Gate(scheduler.run_batch)
    scheduler.run_batch = gate
    return gate


def _call(user_id: int) -> RankCall:
    items = np.arange(1, 41, dtype=np.int64)
    return RankCall(request_id=f"u{user_id}", user_id=user_id,
                    prefix=PrefixPayload(PrefixId(user_id, 40, 1000 + user_id), items, None),
                    candidates=np.arange(100, 116, dtype=np.int64))


async def _healthy(replica: RankingReplica) -> bool:
    try:
        await replica.check_health()
    except ReplicaUnhealthyError:
        return False
    return True


async def _until(healthy: bool, replica: RankingReplica) -> None:
    """Wait (on the work of the instance's worker thread, not on a duration) until the
    replica's health is ``healthy``: a minute at most."""
    for _ in range(6000):
        if await _healthy(replica) is healthy:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the replica never became {'healthy' if healthy else 'unhealthy'}")


def test_an_idle_replica_and_one_that_answers_are_healthy() -> None:
    async def main() -> None:
        replica, clock = _replica()
        assert await _healthy(replica)                  # not started yet: nothing to judge
        await replica.state(ControlCall(op="state"))    # starts its instance
        clock.now_s = 100.0
        assert await _healthy(replica)
        reply = await replica.rank(_call(1))
        assert isinstance(reply, RankReply) and reply.path is not None
        clock.now_s = 200.0
        assert await _healthy(replica)
        await replica.instance.stop()

    asyncio.run(main())


def test_a_stuck_ranking_call_makes_the_replica_unhealthy_until_it_is_answered() -> None:
    async def main() -> None:
        replica, clock = _replica()
        gate = _gate(replica)
        call = asyncio.create_task(replica.rank(_call(1)))
        await gate.entered()                            # the pass is on the worker, held
        clock.now_s = DEADLINE_S - 0.5
        assert await _healthy(replica)
        clock.now_s = DEADLINE_S
        with pytest.raises(ReplicaUnhealthyError,
                           match=r"replica r0: ranking call unanswered, and no ranking call "
                                 r"answered, for 5\.00 s"):
            await replica.check_health()
        gate.release()
        await call
        assert await _healthy(replica)
        await replica.instance.stop()

    asyncio.run(main())


def test_a_busy_replica_that_answers_its_queue_is_healthy() -> None:
    """Two calls, each held 4 s on the worker: the second waits 7 s in all, past the deadline,
    but the replica answered the first meanwhile. Once it stops answering, the deadline runs
    from its last answer."""
    async def main() -> None:
        replica, clock = _replica()
        gate = _gate(replica)
        first = asyncio.create_task(replica.rank(_call(1)))
        await gate.entered()
        clock.now_s = 1.0
        second = asyncio.create_task(replica.rank(_call(2)))
        await asyncio.sleep(0)
        clock.now_s = 4.0
        gate.release()
        await first                                     # answered at 4.0
        await gate.entered()                            # the second's pass, held
        clock.now_s = 8.0                               # 7 s since it was sent, 4 s since 4.0
        assert await _healthy(replica)
        clock.now_s = 4.0 + DEADLINE_S
        assert not await _healthy(replica)
        gate.release()
        await second
        assert await _healthy(replica)
        await replica.instance.stop()

    asyncio.run(main())


def test_calls_the_replica_sheds_do_not_hide_a_stuck_instance() -> None:
    """A stuck instance's queue fills and the replica sheds what comes next at once: those
    answers are the replica's, not the instance's progress."""
    async def main() -> None:
        replica, clock = _replica(overload={"max_rank_queue_depth": 1})
        gate = _gate(replica)
        held = asyncio.create_task(replica.rank(_call(1)))
        await gate.entered()
        queued = asyncio.create_task(replica.rank(_call(2)))
        await asyncio.sleep(0)
        clock.now_s = DEADLINE_S - 0.5
        shed = await replica.rank(_call(3))
        assert shed.overloaded_retry_s is not None
        clock.now_s = DEADLINE_S
        assert not await _healthy(replica)
        gate.release()
        await held
        await gate.entered()
        gate.release()
        await queued
        assert await _healthy(replica)
        await replica.instance.stop()

    asyncio.run(main())


def test_a_call_whose_caller_gave_up_still_counts_until_the_instance_ends_it() -> None:
    """Serve cancels a call whose client went away; the instance's work for it goes on (as a
    worker process's does), and a stuck one is still seen."""
    async def main() -> None:
        replica, clock = _replica()
        gate = _gate(replica)
        call = asyncio.create_task(replica.rank(_call(1)))
        await gate.entered()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        clock.now_s = DEADLINE_S
        assert not await _healthy(replica)
        gate.release()
        await _until(True, replica)                     # the held pass ends: answered
        await replica.instance.stop()

    asyncio.run(main())


def test_a_stopped_instance_makes_the_replica_unhealthy() -> None:
    async def main() -> None:
        replica, _ = _replica()
        await replica.state(ControlCall(op="state"))
        await replica.instance.stop()
        with pytest.raises(ReplicaUnhealthyError, match="replica r0: its ranking instance is "
                                                        "stopped"):
            await replica.check_health()

    asyncio.run(main())


async def _raises(replica: RankingReplica, user_id: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        await replica.rank(_call(user_id))


def test_a_replica_whose_ranking_calls_raise_in_a_row_fails_until_it_is_replaced() -> None:
    """``errors_to_open`` (3) instance errors in a row fail the check, with the reason, and the
    replica's snapshots say so; an answer after that changes nothing (Serve replaces it)."""
    async def main() -> None:
        replica, _ = _replica()
        passes = failing_passes(replica.instance, DEVICE_ERROR)
        for user in (1, 2):
            await _raises(replica, user, RuntimeError)
            assert await _healthy(replica)
        await _raises(replica, 3, RuntimeError)
        with pytest.raises(ReplicaUnhealthyError, match=OPEN):
            await replica.check_health()
        state = await replica.state(ControlCall(op="state"))
        assert not state.snapshot.healthy and state.snapshot.unhealthy_reason == BREAKER_OPEN
        passes.error = None
        reply = await replica.rank(_call(4))                # answered, but too late
        assert reply.path is not None and reply.snapshot is not None
        assert not reply.snapshot.healthy and reply.snapshot.unhealthy_reason == BREAKER_OPEN
        with pytest.raises(ReplicaUnhealthyError, match=OPEN):
            await replica.check_health()
        await replica.instance.stop()

    asyncio.run(main())


def test_an_answer_between_instance_errors_starts_the_count_again() -> None:
    async def main() -> None:
        replica, _ = _replica()
        passes = failing_passes(replica.instance, DEVICE_ERROR)
        await _raises(replica, 1, RuntimeError)
        await _raises(replica, 2, RuntimeError)
        passes.error = None
        assert (await replica.rank(_call(3))).path is not None
        passes.error = DEVICE_ERROR
        await _raises(replica, 4, RuntimeError)
        await _raises(replica, 5, RuntimeError)
        state = await replica.state(ControlCall(op="state"))
        assert await _healthy(replica) and state.snapshot.healthy
        await _raises(replica, 6, RuntimeError)
        assert not await _healthy(replica)
        await replica.instance.stop()

    asyncio.run(main())


def test_the_requests_own_errors_and_shed_replies_neither_count_nor_reset() -> None:
    """Between the second instance error and the third: the request's own errors (its input
    refused, the history store out of reach) and calls the replica shed. The replica stays
    healthy through them, and the third instance error still opens its breaker."""
    async def main() -> None:
        replica, _ = _replica(overload={"max_rank_queue_depth": 1})
        passes = failing_passes(replica.instance, DEVICE_ERROR)
        await _raises(replica, 1, RuntimeError)
        await _raises(replica, 2, RuntimeError)
        for error in [SequenceTooLongError("prefix + suffix past max_seq_len (injected)"),
                      HistoryStoreUnavailableError("the store is out of reach (injected)")] * 2:
            passes.error = error
            await _raises(replica, 3, type(error))
            assert await _healthy(replica)
        passes.error = DEVICE_ERROR
        gate = _gate(replica)
        held = asyncio.create_task(replica.rank(_call(4)))      # the third instance error
        await gate.entered()
        queued = asyncio.create_task(replica.rank(_call(5)))
        await asyncio.sleep(0)
        for user in (6, 7, 8):
            assert (await replica.rank(_call(user))).overloaded_retry_s is not None
        assert await _healthy(replica)
        gate.release()
        with pytest.raises(RuntimeError):
            await held
        with pytest.raises(ReplicaUnhealthyError, match=OPEN):
            await replica.check_health()
        await gate.entered()
        gate.release()
        with pytest.raises(RuntimeError):
            await queued
        await replica.instance.stop()

    asyncio.run(main())


class _Crash(BaseException):
    """What no ``except Exception`` in the scheduler catches."""


def test_a_dead_scheduler_makes_the_replica_unhealthy_at_once() -> None:
    async def main() -> None:
        replica, _ = _replica()
        scheduler = replica.instance.scheduler

        def crash(payloads: list[Any]) -> list[Any]:
            raise _Crash("the worker died")

        scheduler.run_batch = crash
        call = asyncio.create_task(replica.rank(_call(1)))
        await _until(False, replica)                    # the scheduler's loop has ended
        with pytest.raises(ReplicaUnhealthyError,
                           match=r"replica r0: its scheduler's loop ended \(_Crash"):
            await replica.check_health()
        call.cancel()
        await replica.instance.stop()

    asyncio.run(main())


def test_serve_checks_the_ranking_replicas_as_configured() -> None:
    spec = RayAppSpec(SOURCE, system_config(), ServerConfig(),
                      health=HealthCheckPolicy(period_s=2.0, timeout_s=7.0))
    options = ranking_deployment_options(spec)
    assert (options["health_check_period_s"], options["health_check_timeout_s"]) == (2.0, 7.0)
    default = ranking_deployment_options(RayAppSpec(SOURCE, system_config(), ServerConfig()))
    assert (default["health_check_period_s"], default["health_check_timeout_s"]) == (1.0, 5.0)


@pytest.mark.parametrize("field", ["period_s", "timeout_s"])
def test_health_check_times_must_be_positive(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        HealthCheckPolicy(**{field: 0.0})  # type: ignore[arg-type]
