"""The one config loader: unknown keys refused by name, values validated and converted, every
failure one ConfigError naming the class and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaygr.cascade.config import SystemConfig
from relaygr.errors import ConfigError
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


@pytest.mark.parametrize(("cls", "data", "says"), [
    (SystemConfig, {"slo_msec": 1}, "unknown SystemConfig keys: ['slo_msec']"),
    (SystemConfig, {"slo_ms": "fast"}, "SystemConfig.slo_ms: Input should be a valid number"),
    (SystemConfig, {"slo_ms": -1}, "SystemConfig.slo_ms must be > 0"),          # its own check
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
