"""Trigger: every reason, counters, token-bucket refill on a fake clock, the ablation policy."""

from __future__ import annotations

import pytest

from relaygr.errors import ConfigError, InvalidInputError
from relaygr.relay import (
    TRIGGERS,
    CostModelSource,
    InstanceLoad,
    LatencyCostModel,
    PoolUsage,
    TokenBucket,
    TriggerConfig,
    TriggerDecision,
    TriggerReason,
    TriggerRequest,
    make_trigger,
)
from relaygr.relay.costmodel import CACHED_FEATURES, FULL_FEATURES, PREFILL_FEATURES
from relaygr.relay.fitting import LinearFit


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def linear_model() -> LatencyCostModel:
    """Full pass: 1 ms + 0.01 ms per history token; cached: 1 ms + 0.001 ms per prefix token."""
    src = CostModelSource("measured", "cpu", "float32", None)
    return LatencyCostModel(LinearFit(PREFILL_FEATURES, (1.0, 0.01, 0.0), 0, 0, 1),
                            LinearFit(FULL_FEATURES, (1.0, 0.01, 0.0, 0.0, 0.0), 0, 0, 1),
                            LinearFit(CACHED_FEATURES, (1.0, 0.001, 0.0, 0.0, 0.0, 0.0), 0, 0, 1),
                            src)


# SLO 20 ms, risk at > 10 ms: a history of more than 900 tokens is at risk.
SLO_MS = 20.0
CONFIG = TriggerConfig(risk_fraction=0.5, max_pool_fraction=0.5,
                       max_preinfer_tokens_per_s=1000.0, burst_tokens=2000.0)
POOL = PoolUsage(used_bytes=0, budget_bytes=1000)


def request(prefix: int, prefix_bytes: int = 100, host: bool = False) -> TriggerRequest:
    return TriggerRequest(user_id=1, prefix_tokens=prefix, suffix_tokens=0, candidates=8,
                          prefix_bytes=prefix_bytes, host_has_prefix=host)


def test_each_reason_in_order_and_counted() -> None:
    clock = FakeClock()
    trigger = make_trigger("sequence-aware", linear_model(), CONFIG, SLO_MS, clock)
    # pytest.approx stands in for the floats: the dataclass's == compares field by field
    assert trigger.decide(request(900), POOL) == TriggerDecision(
        False, TriggerReason.NOT_AT_RISK,
        pytest.approx(10.0), pytest.approx(1.9), pytest.approx(10.0))  # type: ignore[arg-type]
    assert trigger.decide(request(0), POOL).reason is TriggerReason.NOT_AT_RISK
    # At risk but the host tier holds it: reload, even when the pool is full.
    full_pool = PoolUsage(used_bytes=450, budget_bytes=1000)
    assert trigger.decide(request(901, host=True), full_pool).reason is TriggerReason.HOST_HIT
    # 450 + 100 > 0.5 * 1000; 400 + 100 fits exactly.
    assert trigger.decide(request(1000), full_pool).reason is TriggerReason.FOOTPRINT_FULL
    assert trigger.decide(request(1000), PoolUsage(400, 1000)) == TriggerDecision(
        True, TriggerReason.ADMITTED,
        pytest.approx(11.0), pytest.approx(2.0), pytest.approx(11.0))  # type: ignore[arg-type]
    assert trigger.bucket.level_tokens == 1000.0
    assert trigger.decide(request(1000), POOL).admit
    assert trigger.decide(request(1000), POOL).reason is TriggerReason.LOAD_BOUND
    assert trigger.counts == {TriggerReason.ADMITTED: 2, TriggerReason.NOT_AT_RISK: 2,
                              TriggerReason.HOST_HIT: 1, TriggerReason.FOOTPRINT_FULL: 1,
                              TriggerReason.LOAD_BOUND: 1}
    # Refused decisions took no tokens; half a second refills 500.
    assert trigger.bucket.level_tokens == 0.0
    clock.now_s += 0.5
    assert trigger.decide(request(1000), POOL).reason is TriggerReason.LOAD_BOUND
    clock.now_s += 0.5
    assert trigger.decide(request(1000), POOL).reason is TriggerReason.ADMITTED
    # An admission whose pre-infer did not start is withdrawn: its tokens come back.
    trigger.withdraw(request(1000))
    assert trigger.bucket.level_tokens == 1000.0


def test_risk_is_judged_at_the_instance_load() -> None:
    # 500 tokens: a 6-ms pass, within the 10-ms risk line on an idle instance; at 50 % busy
    # the expected time in system doubles it (12 ms: at risk); at 40 %, 10 ms (the line itself).
    trigger = make_trigger("sequence-aware", linear_model(), CONFIG, SLO_MS, FakeClock())
    assert trigger.decide(request(500), POOL).reason is TriggerReason.NOT_AT_RISK
    half_busy = trigger.decide(request(500), POOL, InstanceLoad(0.5))
    assert half_busy.admit and half_busy.predicted_full_ms == pytest.approx(6.0)
    assert half_busy.predicted_full_at_load_ms == pytest.approx(12.0)
    assert not trigger.decide(request(500), POOL, InstanceLoad(1 - 0.6)).admit
    # Saturation is capped at 90 % busy (x10), so a prediction stays finite.
    assert InstanceLoad(0.95).latency_factor == InstanceLoad(1.0).latency_factor
    assert InstanceLoad(1.0).latency_factor == pytest.approx(10.0)
    with pytest.raises(InvalidInputError, match="busy_fraction"):
        InstanceLoad(1.5)


def test_preinfer_all_admits_every_prefix_that_fits() -> None:
    trigger = make_trigger("preinfer-all", linear_model(), CONFIG, SLO_MS, FakeClock())
    decisions = [trigger.decide(request(10), POOL) for _ in range(50)]
    assert all(d.reason is TriggerReason.ADMITTED for d in decisions)
    assert trigger.decide(request(5000), POOL).admit            # no load bound either
    assert trigger.decide(request(10, host=True), POOL).reason is TriggerReason.HOST_HIT
    assert trigger.decide(request(10, 600), POOL).reason is TriggerReason.FOOTPRINT_FULL
    assert trigger.decide(request(0), POOL).reason is TriggerReason.NOT_AT_RISK
    assert trigger.counts[TriggerReason.ADMITTED] == 51
    trigger.withdraw(request(10))          # nothing was taken, nothing comes back
    assert trigger.bucket.level_tokens == CONFIG.burst_tokens
    assert trigger.counts[TriggerReason.LOAD_BOUND] == 0


def test_token_bucket_refills_at_its_rate_up_to_its_capacity() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_tokens_per_s=100.0, capacity_tokens=300.0, clock=clock)
    assert bucket.try_take(250) and bucket.level_tokens == 50.0
    assert not bucket.try_take(60) and bucket.level_tokens == 50.0
    clock.now_s += 0.125                                      # dyadic: exact in binary
    assert bucket.try_take(62.5) and bucket.level_tokens == 0.0
    clock.now_s += 100.0
    assert bucket.level_tokens == 300.0                       # capped at capacity
    # A job larger than the bucket runs only from a full bucket, then is paid back.
    assert bucket.try_take(500) and bucket.level_tokens == -200.0
    clock.now_s += 2.0
    assert not bucket.try_take(1) and bucket.level_tokens == 0.0
    clock.now_s -= 50.0                                       # a clock stepping back adds nothing
    assert bucket.level_tokens == 0.0
    with pytest.raises(InvalidInputError):
        bucket.try_take(-1)
    # Tokens taken for work that did not run come back, never above the capacity.
    bucket.give_back(120.0)
    assert bucket.level_tokens == 120.0
    bucket.give_back(1000.0)
    assert bucket.level_tokens == 300.0
    with pytest.raises(InvalidInputError):
        bucket.give_back(-1)
    with pytest.raises(ConfigError):
        TokenBucket(0.0, 10.0, clock)


def test_config_and_request_validation() -> None:
    assert sorted(TRIGGERS) == ["preinfer-all", "sequence-aware"]
    with pytest.raises(ConfigError, match="unknown trigger"):
        make_trigger("always", linear_model(), CONFIG, SLO_MS)
    with pytest.raises(ConfigError, match="slo_ms must be > 0"):
        make_trigger("sequence-aware", linear_model(), CONFIG, 0.0)
    with pytest.raises(ConfigError, match="unknown TriggerConfig keys"):
        TriggerConfig.from_dict({"risk": 0.3})
    assert TriggerConfig.from_dict({"burst_tokens": 10}) == TriggerConfig(burst_tokens=10.0)
    for bad, says in (({"risk_fraction": 1.5}, "TriggerConfig.risk_fraction must be in"),
                      ({"burst_tokens": 0.0}, "TriggerConfig.burst_tokens must be > 0")):
        with pytest.raises(ConfigError, match=says):
            TriggerConfig(**bad)
    with pytest.raises(InvalidInputError, match="prefix_tokens"):
        request(-1)
    with pytest.raises(InvalidInputError, match="impossible"):
        PoolUsage(used_bytes=11, budget_bytes=10)
