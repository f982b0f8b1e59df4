"""Configuration of a relay system: frozen, validated at construction, unknown keys rejected.

A ``SystemConfig`` is composed of the configurations its parts take, each stating its own
defaults (with the reasons) and checking its own fields: ``instance`` (every ranking instance's
resources and policies, ``engine.instance.InstanceConfig``, with its batching,
``engine.scheduler.BatchPolicy``), ``trigger`` (``relay.trigger.TriggerConfig``), ``affinity``
(the affinity router's spill, ``routing.affinity.AffinityConfig``), ``stages`` (the earlier
stages as the ranking stage sees them, ``StagesConfig``), ``overload`` (when an instance
sheds and refuses work, ``OverloadConfig``) and ``breaker`` (when an instance whose ranking calls
raise leaves routing, ``cascade.breaker.BreakerConfig``). The system's own fields are those no
part owns: the mode, the fleet, the SLO and the history window's slide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from relaygr.cascade.breaker import BreakerConfig
from relaygr.cascade.modes import Mode
from relaygr.engine.instance import InstanceConfig
from relaygr.errors import ConfigError
from relaygr.relay.trigger import TriggerConfig
from relaygr.routing.affinity import AffinityConfig
from relaygr.settings import changed, load, require_positive_ints

# The stage delays where a trained retrieval stage serves (``relaygr serve --retrieval-run``):
# its time is measured on the request's path, so nothing simulated is added unless a
# configuration asks for it explicitly. ``StagesConfig`` fields: ``system.with_(stages=...)``.
MEASURED_STAGE_DELAYS: dict[str, float] = {"retrieval_delay_ms": 0.0, "preprocess_delay_ms": 0.0}


@dataclass(frozen=True)
class StagesConfig:
    """The earlier stages (retrieval, pre-processing) as the ranking stage sees them: how many
    candidates they hand over, how long they take, and how their score joins the ranker's."""

    # Items retrieved before pre-processing filters the history out and keeps num_candidates.
    retrieval_k: int = 1024
    num_candidates: int = 256
    # Retrieval's user vector, of the default stage (the ranker's item embeddings) and of a
    # trained run's tower (an HSTU run as the stage reads the whole history): a mean over the
    # user's latest retrieval_history events in which the k-th newest weighs
    # retrieval_recency ** k (1: the plain mean of the window; the tower counts a recurring item
    # once, at its newest weight). ML-1M's next item follows the latest few events: chosen on its
    # validation users, the item-embeddings stage's recall@200 is 0.615 at 0.7 (the window
    # long enough not to matter: 0.7 ** 64 ~ 1e-10), 0.595 for the plain mean of the latest 4
    # and 0.391 of the latest 64 (docs/retrieval.md, "MovieLens-1M")
    retrieval_history: int = 64
    retrieval_recency: float = 0.7
    # Where a trained retrieval run serves (relaygr train-retrieval; --retrieval-run), the share
    # of the retrieved list its tower proposes; of the rest, the share an item-to-item channel
    # built from the run's training interactions proposes (cascade.item_cf: each item's
    # retrieval_item_cf_neighbours most similar items by cosine over their users; 0: no such
    # channel), the default stage the remainder, all interleaved so that every prefix holds
    # each channel in its share (cascade.proposals.InterleavedRetrieval). Run share 1: the run
    # alone. The channels find different items: on ML-1M's validation users thirds (1/3, and
    # half the rest) found the most (recall@200 0.683 against 0.671 for the run and the default
    # at a half each, 0.615 for the default alone; 100 neighbours: 50 within noise of it, 200
    # and 400 below), and on its test users 0.011-0.013 more than the two channels
    # (docs/retrieval.md, "MovieLens-1M: the cascade's stage").
    retrieval_run_share: float = 0.33
    retrieval_item_cf_rest_share: float = 0.5
    retrieval_item_cf_neighbours: int = 100
    # Time the earlier stages spend on their own (simulated) fleets: the window pre-inference
    # hides in. A request waits for them even when its retrieval computed faster; with a
    # trained retrieval stage they default to 0 instead (MEASURED_STAGE_DELAYS).
    retrieval_delay_ms: float = 30.0
    preprocess_delay_ms: float = 20.0
    # /v1/recommend orders by ranker score + stage_weight x the retrieval stage's score (both
    # computed as now, fused after ranking; relaygr eval's CascadeSpec.stage_weight). 0: the
    # ranker alone, as a cascade that does not fuse.
    stage_weight: float = 0.0

    def __post_init__(self) -> None:
        require_positive_ints(self, "retrieval_k", "num_candidates", "retrieval_history",
                              "retrieval_item_cf_neighbours")
        for name in ("retrieval_recency", "retrieval_run_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"StagesConfig.{name} must be in (0, 1], got "
                                  f"{getattr(self, name)!r}")
        for name in ("retrieval_delay_ms", "preprocess_delay_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"StagesConfig.{name} must be >= 0")
        if not 0 <= self.retrieval_item_cf_rest_share <= 1:
            raise ConfigError("StagesConfig.retrieval_item_cf_rest_share must be in [0, 1], got "
                              f"{self.retrieval_item_cf_rest_share!r}")
        if not (math.isfinite(self.stage_weight) and self.stage_weight >= 0):
            raise ConfigError("StagesConfig.stage_weight must be finite and >= 0, got "
                              f"{self.stage_weight!r}")
        if self.retrieval_k < self.num_candidates:
            raise ConfigError("StagesConfig.retrieval_k must be >= num_candidates")

    @property
    def retrieval_shares(self) -> tuple[float, float, float]:
        """Where a trained run serves: the shares of the list of the default stage, the run and
        its item-to-item channel (``retrieval_run_share``, ``retrieval_item_cf_rest_share``)."""
        rest = 1 - self.retrieval_run_share
        item_cf = rest * self.retrieval_item_cf_rest_share
        return rest - item_cf, self.retrieval_run_share, item_cf

    @property
    def delay_s(self) -> float:
        """The earlier stages' simulated time, retrieval and pre-processing together."""
        return (self.retrieval_delay_ms + self.preprocess_delay_ms) / 1e3


@dataclass(frozen=True)
class OverloadConfig:
    """When an instance sheds or refuses work, in queued ranking requests.

    Past ``shed_preinfer_queue_depth`` an instance takes no new pre-infer work, and past
    ``max_rank_queue_depth`` it refuses ranking (HTTP 503) instead of queueing without bound.
    Pre-infer is shed first because ranking still answers without it.
    """

    shed_preinfer_queue_depth: int = 8
    max_rank_queue_depth: int = 64

    def __post_init__(self) -> None:
        require_positive_ints(self, "shed_preinfer_queue_depth", "max_rank_queue_depth")


@dataclass(frozen=True)
class SystemConfig:
    """One relay system: its mode, fleet and SLO, and its parts' configurations."""

    mode: str = "relay"
    num_instances: int = 2
    # Instance i runs on devices[i % len(devices)].
    devices: tuple[str, ...] = ("cpu",)
    # The ranking stage's P99 budget; the trigger's risk test is relative to it.
    slo_ms: float = 100.0
    # The model reads a history's newest max_seq_len events, from a start that moves in blocks
    # of this fraction of max_seq_len (at least 1 event; cascade.window). An eighth: the model
    # reads at least 7/8 of what it could, and a long user's window is computed afresh (one full
    # pass) once per max_seq_len / 8 appended events (512 at 4096: a hundred visits of a few).
    window_slide_fraction: float = 0.125
    instance: InstanceConfig = field(default_factory=InstanceConfig)
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    # The affinity router's spill, in the modes that route by affinity (a mode's own router
    # options come first: the reactive mode never spills).
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    overload: OverloadConfig = field(default_factory=OverloadConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def __post_init__(self) -> None:
        Mode.parse(self.mode)
        require_positive_ints(self, "num_instances")
        if not self.devices:
            raise ConfigError("SystemConfig.devices must name at least one device")
        if not self.slo_ms > 0:
            raise ConfigError("SystemConfig.slo_ms must be > 0")
        if not 0 < self.window_slide_fraction <= 0.5:
            raise ConfigError("SystemConfig.window_slide_fraction must be in (0, 0.5], got "
                              f"{self.window_slide_fraction!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SystemConfig:
        return load(cls, data)

    def with_(self, **changes: Any) -> SystemConfig:
        """This config with ``changes``; a mapping for a part changes only the fields it names
        (``with_(stages={"stage_weight": 0.5})``)."""
        return changed(self, **changes)
