"""The circuit breaker's states on given times, and whose fault a ranking call's error is."""

from __future__ import annotations

import asyncio

import pytest

from relaygr.cascade.breaker import BreakerConfig, BreakerState, CircuitBreaker
from relaygr.cascade.config import SystemConfig
from relaygr.cascade.fleet import InstanceFailed, InstanceLost, failover_for
from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.errors import (
    CacheStateError,
    ConfigError,
    HistoryStoreUnavailableError,
    IncompatiblePrefixError,
    OverloadedError,
    SequenceTooLongError,
)

BOOM = RuntimeError("CUDA error: an illegal memory access was encountered")


def test_errors_in_a_row_open_it_and_an_answer_between_them_starts_the_count_again() -> None:
    breaker = CircuitBreaker(BreakerConfig(errors_to_open=3, cool_down_s=10.0))
    for now in (0.0, 1.0):
        assert not breaker.raised(breaker.send(now), now, BOOM)
    assert not breaker.answered(breaker.send(2.0)) and breaker.errors == 0
    for now in (3.0, 4.0):
        assert not breaker.raised(breaker.send(now), now, BOOM)
    assert breaker.routable(4.0) and breaker.reason is None
    assert breaker.raised(breaker.send(5.0), 5.0, BOOM)
    assert breaker.state(5.0) is BreakerState.OPEN and breaker.opened == 1
    assert not breaker.routable(14.9)
    assert breaker.reason == ("circuit breaker open: 3 ranking calls in a row raised (the last: "
                              "RuntimeError: CUDA error: an illegal memory access was "
                              "encountered)")
    # legs sent before it opened say nothing of the instance now
    assert not breaker.raised(False, 6.0, BOOM) and not breaker.answered(False)
    assert breaker.state(6.0) is BreakerState.OPEN and breaker.opened == 1


def test_after_the_cool_down_one_probe_at_a_time_decides() -> None:
    breaker = CircuitBreaker(BreakerConfig(errors_to_open=1, cool_down_s=10.0))
    assert breaker.raised(breaker.send(0.0), 0.0, BOOM)
    assert breaker.state(10.0) is BreakerState.HALF_OPEN and breaker.routable(10.0)
    probe = breaker.send(10.0)
    assert probe and not breaker.routable(10.0)         # the probe is out: no other leg
    assert not breaker.send(10.0)                        # a leg sent anyway is no probe
    assert breaker.raised(probe, 11.0, RuntimeError("again"))      # a failed probe: open again
    assert breaker.state(20.9) is BreakerState.OPEN and breaker.opened == 2
    assert breaker.reason == "circuit breaker open: its probe raised RuntimeError: again"
    probe = breaker.send(21.0)
    breaker.proved_nothing(probe)                        # the request's own error, say
    assert breaker.routable(21.0) and breaker.reason is not None
    assert breaker.answered(breaker.send(21.0))          # the next leg probes, and answers
    assert breaker.state(21.0) is BreakerState.CLOSED and breaker.reason is None
    assert breaker.errors == 0 and breaker.routable(21.0)


def test_a_first_leg_reserves_the_probe_for_its_ranking_leg_until_it_lapses() -> None:
    breaker = CircuitBreaker(BreakerConfig(errors_to_open=1, cool_down_s=10.0))
    assert breaker.raised(breaker.send(0.0), 0.0, BOOM)
    assert not breaker.reserve(9.0, "r1", 2.0)            # open: nothing to reserve
    assert breaker.reserve(10.0, "r1", 2.0)
    assert not breaker.reserve(10.0, "r2", 2.0)           # one reservation at a time
    assert breaker.routable(11.0, "r1") and not breaker.routable(11.0, "r2")
    assert not breaker.routable(11.0)                    # nor any other first leg
    assert not breaker.send(11.0, "r2")                   # a leg sent anyway is no probe
    probe = breaker.send(11.0, "r1")                      # the holder's ranking leg
    assert probe and not breaker.routable(11.0, "r1")    # the probe is out
    assert breaker.raised(probe, 11.5, BOOM) and breaker.state(21.0) is BreakerState.OPEN
    # a reservation whose ranking leg never comes lapses after hold_s
    assert breaker.reserve(21.5, "r3", 2.0)
    assert not breaker.routable(23.4) and breaker.routable(23.5)
    assert breaker.reserve(23.5, "r4", 2.0) and not breaker.send(23.6, "r3")
    # a holder whose ranking leg goes elsewhere gives the probe to the next request
    breaker.release("r4")
    assert breaker.routable(23.6) and breaker.answered(breaker.send(23.6, "r5"))
    assert breaker.state(23.6) is BreakerState.CLOSED and breaker.routable(23.6, "r4")
    assert not breaker.reserve(23.6, "r6", 2.0)           # closed: nothing to reserve


def test_the_breakers_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="errors_to_open must be a positive int, got 0"):
        BreakerConfig(errors_to_open=0)
    with pytest.raises(ConfigError, match="cool_down_s must be > 0"):
        BreakerConfig(cool_down_s=0.0)
    with pytest.raises(ConfigError, match=r"SystemConfig\.breaker\.errors_to_open must be a "
                                          r"positive int"):
        SystemConfig.from_dict({"breaker": {"errors_to_open": 0}})
    with pytest.raises(ConfigError, match=r"unknown SystemConfig\.breaker keys: \['errors'\]"):
        SystemConfig.from_dict({"breaker": {"errors": 3}})
    assert SystemConfig().breaker == BreakerConfig(errors_to_open=3, cool_down_s=10.0)


@pytest.mark.parametrize("error", [BOOM, CacheStateError("index inconsistent"),
                                   ValueError("a bug"), MemoryError()])
def test_anything_else_a_ranking_call_raises_is_the_instances_fault(error: Exception) -> None:
    failover = failover_for("rank-1", error)
    assert isinstance(failover, InstanceFailed) and failover.instance == "rank-1"
    assert failover.error is error and type(error).__name__ in str(failover)


@pytest.mark.parametrize("error", [
    SequenceTooLongError("prefix + suffix past max_seq_len"),
    IncompatiblePrefixError("another model's prefix"), OverloadedError("queue full"),
    HistoryStoreUnavailableError("store timeout"), AssertionError("an invariant broke"),
    asyncio.CancelledError()])
def test_the_requests_own_errors_and_broken_invariants_are_not_failed_over(
        error: BaseException) -> None:
    assert failover_for("rank-1", error) is None


def test_an_instance_that_stopped_is_lost_not_failed() -> None:
    failover = failover_for("rank-1", InstanceStoppedError("rank-1 is down"))
    assert type(failover) is InstanceLost and failover.instance == "rank-1"
