"""Configuration of a relay system: frozen, validated at construction, unknown keys rejected."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from relaygr.cascade.modes import Mode
from relaygr.engine.instance import InstanceConfig
from relaygr.engine.scheduler import BatchPolicy
from relaygr.errors import ConfigError
from relaygr.relay.trigger import TriggerConfig
from relaygr.settings import changed, load

MiB = 1 << 20

# Each default is stated once: an instance's resources and policies in engine.InstanceConfig
# (and its batching in engine.scheduler.BatchPolicy), the trigger's thresholds in
# relay.trigger.TriggerConfig, with the reasons for their values. A SystemConfig field that
# configures one of them takes its default from there.


def _default(config: type, name: str) -> Any:
    """The default ``config`` (a dataclass) states for its field ``name``."""
    return next(f.default for f in fields(config) if f.name == name)


# The stage delays where a trained retrieval stage serves (``relaygr serve --retrieval-run``):
# its time is measured on the request's path, so nothing simulated is added unless a
# configuration asks for it explicitly.
MEASURED_STAGE_DELAYS: dict[str, float] = {"retrieval_delay_ms": 0.0, "preprocess_delay_ms": 0.0}


@dataclass(frozen=True)
class SystemConfig:
    """One relay system: its mode, instances, cache budgets, cascade delays and trigger bounds."""

    mode: str = "relay"
    num_instances: int = 2
    # Instance i runs on devices[i % len(devices)].
    devices: tuple[str, ...] = ("cpu",)
    # The ranking stage's P99 budget; the trigger's risk test is relative to it.
    slo_ms: float = 100.0
    # Per instance (engine.InstanceConfig).
    device_budget_bytes: int = _default(InstanceConfig, "device_budget_bytes")
    host_budget_bytes: int = _default(InstanceConfig, "host_budget_bytes")
    page_tokens: int = _default(InstanceConfig, "page_tokens")
    lease_s: float = _default(InstanceConfig, "lease_s")
    host_ttl_s: float = _default(InstanceConfig, "host_ttl_s")
    # Ranking requests merged per model call when several are queued (engine's BatchPolicy).
    batch_max_requests: int = BatchPolicy.max_requests
    # Items retrieved before pre-processing filters the history out and keeps num_candidates.
    retrieval_k: int = 1024
    num_candidates: int = 256
    # Time the earlier stages spend on their own (simulated) fleets: the window pre-inference
    # hides in. A request waits for them even when its retrieval computed faster; with a
    # trained retrieval stage they default to 0 instead (MEASURED_STAGE_DELAYS).
    retrieval_delay_ms: float = 30.0
    preprocess_delay_ms: float = 20.0
    # Latest events that form retrieval's user vector (either strategy's).
    retrieval_history: int = 64
    # /v1/recommend orders by ranker score + stage_weight x the retrieval stage's score (both
    # computed as now, fused after ranking; relaygr eval's CascadeSpec.stage_weight). 0: the
    # ranker alone, as a cascade that does not fuse.
    stage_weight: float = 0.0
    # Affinity router: spill to the next choice when the owner's queue is deeper than this.
    spill_queue_depth: int = 8
    # Trigger: at-risk threshold and bounds (relay.trigger.TriggerConfig).
    risk_fraction: float = _default(TriggerConfig, "risk_fraction")
    max_pool_fraction: float = _default(TriggerConfig, "max_pool_fraction")
    max_preinfer_tokens_per_s: float = _default(TriggerConfig, "max_preinfer_tokens_per_s")
    burst_tokens: float = _default(TriggerConfig, "burst_tokens")
    # None: a miss recomputes the whole prefix (exact); N: rank with the last N events only.
    truncate_to_tokens: int | None = _default(InstanceConfig, "truncate_to_tokens")
    # Overload: past this many queued ranking requests an instance takes no new pre-infer work,
    # and past max_rank_queue_depth it refuses ranking (HTTP 503) instead of queueing without
    # bound. Pre-infer is shed first because ranking still answers without it.
    shed_preinfer_queue_depth: int = 8
    max_rank_queue_depth: int = 64
    # False: the relay works only within one request (MLPerf's closed rules): no host tier, no
    # cache fill at ranking time, and a prefix is freed once its own ranking consumed it.
    cross_request_reuse: bool = _default(InstanceConfig, "cross_request_reuse")
    # The model reads a history's newest max_seq_len events, from a start that moves in blocks
    # of this fraction of max_seq_len (at least 1 event; cascade.window). An eighth: the model
    # reads at least 7/8 of what it could, and a long user's window is computed afresh (one full
    # pass) once per max_seq_len / 8 appended events (512 at 4096: a hundred visits of a few).
    window_slide_fraction: float = 0.125

    def __post_init__(self) -> None:
        Mode.parse(self.mode)
        positive = ("num_instances", "page_tokens", "batch_max_requests", "retrieval_k",
                    "num_candidates", "retrieval_history", "spill_queue_depth",
                    "shed_preinfer_queue_depth", "max_rank_queue_depth")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"SystemConfig.{name} must be a positive int, got {value!r}")
        if not self.devices:
            raise ConfigError("SystemConfig.devices must name at least one device")
        for name in ("slo_ms", "lease_s", "host_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"SystemConfig.{name} must be > 0")
        for name in ("retrieval_delay_ms", "preprocess_delay_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"SystemConfig.{name} must be >= 0")
        if not (math.isfinite(self.stage_weight) and self.stage_weight >= 0):
            raise ConfigError("SystemConfig.stage_weight must be finite and >= 0, got "
                              f"{self.stage_weight!r}")
        if not 0 < self.window_slide_fraction <= 0.5:
            raise ConfigError("SystemConfig.window_slide_fraction must be in (0, 0.5], got "
                              f"{self.window_slide_fraction!r}")
        if self.retrieval_k < self.num_candidates:
            raise ConfigError("SystemConfig.retrieval_k must be >= num_candidates")

    @property
    def stage_delay_s(self) -> float:
        return (self.retrieval_delay_ms + self.preprocess_delay_ms) / 1e3

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SystemConfig:
        return load(cls, data)

    def with_(self, **changes: Any) -> SystemConfig:
        return changed(self, **changes)
