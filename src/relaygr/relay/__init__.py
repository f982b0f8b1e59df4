"""The sequence-aware trigger and the latency cost model it predicts with.

Public names: ``LatencyCostModel`` (+ ``LatencySample``, ``LatencyPrediction``,
``CostModelSource``), ``fit_on_model``, ``FitGrid``, ``Trigger``, ``SequenceAwareTrigger``,
``PreinferAll``, ``make_trigger``, ``TRIGGERS``, ``TriggerConfig``, ``TriggerRequest``,
``PoolUsage``, ``InstanceLoad``, ``TriggerDecision``, ``TriggerReason``, ``TokenBucket``.

Layers (lower never imports upper): ``fitting`` <- ``costmodel`` <- ``measure`` (times a model)
and ``tokenbucket`` <- ``trigger``. The trigger sees the cache only through ``PoolUsage`` and the
caller's ``host_has_prefix``; it never imports the cache or the engine.
"""

from relaygr.relay.costmodel import (
    CostModelSource,
    LatencyCostModel,
    LatencyPrediction,
    LatencySample,
)
from relaygr.relay.measure import FitGrid, fit_on_model
from relaygr.relay.tokenbucket import TokenBucket
from relaygr.relay.trigger import (
    TRIGGERS,
    InstanceLoad,
    PoolUsage,
    PreinferAll,
    SequenceAwareTrigger,
    Trigger,
    TriggerConfig,
    TriggerDecision,
    TriggerReason,
    TriggerRequest,
    make_trigger,
)

__all__ = ["TRIGGERS", "CostModelSource", "FitGrid", "InstanceLoad", "LatencyCostModel",
           "LatencyPrediction", "LatencySample", "PoolUsage", "PreinferAll",
           "SequenceAwareTrigger", "TokenBucket", "Trigger", "TriggerConfig", "TriggerDecision",
           "TriggerReason", "TriggerRequest",
           "fit_on_model", "make_trigger"]
