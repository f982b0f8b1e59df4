"""The one config loader: unknown keys refused by name, values validated and converted, every
failure one ConfigError naming the class and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaygr.cascade.config import StagesConfig, SystemConfig
from relaygr.engine.instance import InstanceConfig
from relaygr.engine.scheduler import BatchPolicy
from relaygr.errors import ConfigError
from relaygr.relay.trigger import TriggerConfig
from relaygr.retrieval.config import SCCDRConfig, StopGradient
from relaygr.server.config import ModelSource
from relaygr.settings import changed, load
from relaygr.train import TrainConfig


def test_json_values_become_the_fields_types() -> None:
    system = load(SystemConfig, {"devices": ["cpu", "cpu"], "slo_ms": 80})
    assert system.devices == ("cpu", "cpu") and system.slo_ms == 80.0
    assert load(SCCDRConfig, {"stop_gradient": "none"}).stop_gradient is StopGradient.NONE
    assert load(ModelSource, {"checkpoint": "runs/x"}).checkpoint == Path("runs/x")
    assert load(TrainConfig, {"max_epochs": 3.0}).max_epochs == 3      # integral: exact
    assert changed(system, num_instances=3) == SystemConfig(devices=("cpu", "cpu"), slo_ms=80.0,
                                                           num_instances=3)


def test_nested_mappings_become_the_parts_configs() -> None:
    system = load(SystemConfig, {"trigger": {"risk_fraction": 0.5},
                                 "instance": {"batch": {"max_requests": 2}, "page_tokens": 32}})
    assert system.trigger == TriggerConfig(risk_fraction=0.5)           # the rest: defaults
    assert system.instance == InstanceConfig(batch=BatchPolicy(max_requests=2), page_tokens=32)
    assert system.stages == StagesConfig()
    # changed: a part's mapping changes the fields it names and keeps the others
    moved = changed(system, instance={"batch": {"max_tokens": 99}}, stages={"stage_weight": 1})
    assert moved.instance == InstanceConfig(batch=BatchPolicy(max_requests=2, max_tokens=99),
                                            page_tokens=32)
    assert moved.stages == StagesConfig(stage_weight=1.0) and moved.trigger == system.trigger
    # a whole part given as a config replaces it
    assert changed(system, trigger=TriggerConfig()).trigger == TriggerConfig()


@pytest.mark.parametrize(("cls", "data", "says"), [
    (SystemConfig, {"slo_msec": 1}, "unknown SystemConfig keys: ['slo_msec']"),
    (SystemConfig, {"slo_ms": "fast"}, "SystemConfig.slo_ms: Input should be a valid number"),
    (SystemConfig, {"slo_ms": -1}, "SystemConfig.slo_ms must be > 0"),          # its own check
    # a part's keys, values and own checks are named by their path from the outer class
    (SystemConfig, {"trigger": {"risk": 0.3}}, "unknown SystemConfig.trigger keys: ['risk']"),
    (SystemConfig, {"instance": {"batch": {"max_request": 2}}},
     "unknown SystemConfig.instance.batch keys: ['max_request']"),
    (SystemConfig, {"trigger": {"risk_fraction": "high"}},
     "SystemConfig.trigger.risk_fraction: Input should be a valid number"),
    (SystemConfig, {"trigger": {"risk_fraction": 1.5}},
     "SystemConfig.trigger.risk_fraction must be in (0, 1], got 1.5"),
    (SystemConfig, {"instance": {"batch": {"max_requests": 0}}},
     "SystemConfig.instance.batch.max_requests must be a positive int, got 0"),
    (SystemConfig, {"stages": {"retrieval_k": 8}},
     "SystemConfig.stages.retrieval_k must be >= num_candidates"),
    (SystemConfig, {"stages": {"retrieval_recency": 0}},
     "SystemConfig.stages.retrieval_recency must be in (0, 1], got 0"),
    (SystemConfig, {"overload": 3}, "SystemConfig.overload: Input should be a dictionary"),
    (TrainConfig, {"max_epochs": 3.5}, "TrainConfig.max_epochs: Input should be a valid integer"),
    (SCCDRConfig, {"stop_gradient": "sometimes"}, "SCCDRConfig.stop_gradient"),
])
def test_every_failure_is_a_config_error_naming_class_and_field(cls: type, data: dict,
                                                                says: str) -> None:
    with pytest.raises(ConfigError, match=None) as caught:
        load(cls, data)
    assert says in str(caught.value)


def test_not_a_mapping_is_refused() -> None:
    with pytest.raises(ConfigError, match="takes a mapping"):
        load(SystemConfig, ["slo_ms", 1])  # type: ignore[arg-type]
