"""The sequence-aware trigger: which requests get their prefix pre-inferred.

A request is *at risk* when the cost model predicts that a full ranking pass over its history,
at the routed instance's current load, would take more than ``risk_fraction`` of the ranking
budget. The cost model gives the pass on an idle device; the load turns it into the latency the
request would see (``InstanceLoad``): a pass that fits at 5 % busy misses once the instance is
half busy and the request queues. Only at-risk requests are worth
pre-inferring; a short history is ranked from scratch within budget and would only take device
memory and compute from the requests that need them. Checks, in order (the first that fails is
the reason):

1. NOT_AT_RISK: the full pass fits the budget; take the normal path.
2. HOST_HIT: the host tier already holds this user's prefix; reload it, do not recompute it.
3. FOOTPRINT_FULL: the entry would push the device pool past ``max_pool_fraction`` of its budget.
4. LOAD_BOUND: the pre-infer token rate would exceed its bound (a token bucket).
5. ADMITTED: pre-infer this prefix (its tokens are taken from the bucket).

``PreinferAll`` (the ``relay-no-trigger`` ablation) skips checks 1 and 4: it pre-infers every
request whose entry fits. Decisions are counted by reason. Not thread-safe: one event loop
owns a trigger.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from relaygr.errors import ConfigError, InvalidInputError
from relaygr.relay.costmodel import LatencyCostModel
from relaygr.relay.tokenbucket import Clock, TokenBucket
from relaygr.settings import load


@dataclass(frozen=True)
class TriggerConfig:
    """Admission thresholds and bounds; the risk test is relative to the ranking stage's latency
    budget, which the trigger is given beside them (``slo_ms``: the system's, not the
    trigger's)."""

    # A quarter of the budget: a full pass that long already costs the requests queued behind
    # it (one such pass ahead and half the budget is gone); pre-inferring it moves that work
    # off the critical path, so it counts as at risk.
    risk_fraction: float = 0.25
    # Keep a tenth of the pool for ranking-time reloads and extensions.
    max_pool_fraction: float = 0.9
    # Pre-infer compute bound in history tokens per second (set it from the cost model: the
    # rate the instance can prefill while leaving ranking its share of the device).
    max_preinfer_tokens_per_s: float = 200_000.0
    # Burst allowance: the bucket's size, in tokens (a few long prefixes at once).
    burst_tokens: float = 32_768.0

    def __post_init__(self) -> None:
        for name in ("risk_fraction", "max_pool_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"TriggerConfig.{name} must be in (0, 1], got {value!r}")
        for name in ("max_preinfer_tokens_per_s", "burst_tokens"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"TriggerConfig.{name} must be > 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TriggerConfig:
        return load(cls, data)


class TriggerReason(enum.Enum):
    ADMITTED = "admitted"
    NOT_AT_RISK = "not_at_risk"
    HOST_HIT = "host_hit"
    FOOTPRINT_FULL = "footprint_full"
    LOAD_BOUND = "load_bound"


@dataclass(frozen=True)
class TriggerRequest:
    """What the trigger needs to know about one request: its shape and its cache position.

    ``prefix_tokens`` are the tokens pre-inference would compute, ``prefix_bytes`` the device
    bytes their K/V would take, ``host_has_prefix`` whether the host tier holds them already.
    """

    user_id: int
    prefix_tokens: int
    suffix_tokens: int
    candidates: int
    prefix_bytes: int
    host_has_prefix: bool = False

    def __post_init__(self) -> None:
        for name in ("user_id", "prefix_tokens", "suffix_tokens", "candidates", "prefix_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(f"TriggerRequest.{name} must be an int >= 0, "
                                        f"got {value!r}")


@dataclass(frozen=True)
class PoolUsage:
    """The routed instance's device pool, as the trigger sees it."""

    used_bytes: int
    budget_bytes: int

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0 or not 0 <= self.used_bytes <= self.budget_bytes:
            raise InvalidInputError(f"pool usage {self.used_bytes} of {self.budget_bytes} bytes "
                                    "is impossible")


@dataclass(frozen=True)
class InstanceLoad:
    """How busy the routed instance has been lately: the share of the last window it spent on
    ranking batches (0 idle, 1 saturated; ``InstanceScheduler.rank_busy``). Pre-infer work is
    not counted: a ranking request waits behind at most one of its chunks, and counting it
    would feed back (more pre-inference -> more "load" -> more requests at risk).

    ``latency_factor`` is the mean time in system of an M/M/1 queue over the service time,
    ``1 / (1 - busy)``, capped at ``1 / (1 - MAX_BUSY)``: a pass predicted at ``t`` ms on an
    idle device is expected to take ``t * latency_factor`` ms from arrival at this load.
    """

    busy_fraction: float = 0.0

    MAX_BUSY: ClassVar[float] = 0.9

    def __post_init__(self) -> None:
        if not 0.0 <= self.busy_fraction <= 1.0:
            raise InvalidInputError(f"busy_fraction must be in [0, 1], got {self.busy_fraction!r}")

    @property
    def latency_factor(self) -> float:
        return 1.0 / (1.0 - min(self.busy_fraction, self.MAX_BUSY))


@dataclass(frozen=True)
class TriggerDecision:
    """``admit``: pre-infer now. The predictions are the cost model's (idle device), for logging;
    ``predicted_full_at_load_ms`` is what the risk test compared with the budget."""

    admit: bool
    reason: TriggerReason
    predicted_full_ms: float
    predicted_cached_ms: float
    predicted_full_at_load_ms: float


class Trigger(ABC):
    """Admission policy for pre-inference; ``decide`` is its one decision method."""

    name: ClassVar[str]
    # Whether an admission takes its prefix's tokens from the bucket (the load bound).
    load_bounded: ClassVar[bool]

    def __init__(self, cost_model: LatencyCostModel, config: TriggerConfig, slo_ms: float,
                 clock: Clock = time.monotonic) -> None:
        if not slo_ms > 0:
            raise ConfigError(f"a trigger's slo_ms must be > 0, got {slo_ms!r}")
        self.cost_model = cost_model
        self.config = config
        self.slo_ms = slo_ms
        self.bucket = TokenBucket(config.max_preinfer_tokens_per_s, config.burst_tokens, clock)
        self._counts: Counter[TriggerReason] = Counter()

    @property
    def counts(self) -> dict[TriggerReason, int]:
        """Decisions so far by reason (every reason present, zero if never taken)."""
        return {reason: self._counts[reason] for reason in TriggerReason}

    def decide(self, request: TriggerRequest, pool: PoolUsage,
               load: InstanceLoad | None = None) -> TriggerDecision:
        """Admit or refuse pre-inference of ``request``'s prefix; counts the reason. ``load``
        defaults to an idle instance."""
        full_ms = self.cost_model.full_rank_ms(request.prefix_tokens, request.suffix_tokens,
                                               request.candidates)
        cached_ms = self.cost_model.cached_rank_ms(request.prefix_tokens, request.suffix_tokens,
                                                   request.candidates)
        at_load_ms = full_ms * (load or InstanceLoad()).latency_factor
        reason = self._reason(request, pool, at_load_ms)
        self._counts[reason] += 1
        return TriggerDecision(reason is TriggerReason.ADMITTED, reason, full_ms, cached_ms,
                               at_load_ms)

    def withdraw(self, request: TriggerRequest) -> None:
        """``request`` was admitted but its pre-infer did not start (the pool refused its entry,
        or the job could not be built): whatever the admission took from the load bound goes
        back, since the bound counts compute that runs."""
        if self.load_bounded:
            self.bucket.give_back(request.prefix_tokens)

    @abstractmethod
    def _reason(self, request: TriggerRequest, pool: PoolUsage, at_load_ms: float
                ) -> TriggerReason:
        """The decision (``at_load_ms``: the full pass at the instance's load); only an ADMITTED
        answer may take tokens from the bucket."""

    def _fits(self, request: TriggerRequest, pool: PoolUsage) -> bool:
        limit = self.config.max_pool_fraction * pool.budget_bytes
        return pool.used_bytes + request.prefix_bytes <= limit


class SequenceAwareTrigger(Trigger):
    """Pre-infer only at-risk requests, within the footprint and load bounds (module doc)."""

    name = "sequence-aware"
    load_bounded = True

    def _reason(self, request: TriggerRequest, pool: PoolUsage, at_load_ms: float
                ) -> TriggerReason:
        if request.prefix_tokens == 0 or \
                at_load_ms <= self.config.risk_fraction * self.slo_ms:
            return TriggerReason.NOT_AT_RISK
        if request.host_has_prefix:
            return TriggerReason.HOST_HIT
        if not self._fits(request, pool):
            return TriggerReason.FOOTPRINT_FULL
        if not self.bucket.try_take(request.prefix_tokens):
            return TriggerReason.LOAD_BOUND
        return TriggerReason.ADMITTED


class PreinferAll(Trigger):
    """Pre-infer every request with a prefix whose entry fits the pool (no risk or load test).

    A request with no prefix tokens is NOT_AT_RISK (there is nothing to pre-infer)."""

    name = "preinfer-all"
    load_bounded = False

    def _reason(self, request: TriggerRequest, pool: PoolUsage, at_load_ms: float
                ) -> TriggerReason:
        if request.prefix_tokens == 0:
            return TriggerReason.NOT_AT_RISK
        if request.host_has_prefix:
            return TriggerReason.HOST_HIT
        if not self._fits(request, pool):
            return TriggerReason.FOOTPRINT_FULL
        return TriggerReason.ADMITTED


TRIGGERS: dict[str, type[Trigger]] = {t.name: t for t in (SequenceAwareTrigger, PreinferAll)}


def make_trigger(name: str, cost_model: LatencyCostModel, config: TriggerConfig, slo_ms: float,
                 clock: Clock = time.monotonic) -> Trigger:
    """A fresh trigger of the named policy (``sequence-aware`` or ``preinfer-all``) for a ranking
    stage whose latency budget is ``slo_ms``."""
    if name not in TRIGGERS:
        raise ConfigError(f"unknown trigger {name!r}; choose one of {sorted(TRIGGERS)}")
    return TRIGGERS[name](cost_model, config, slo_ms, clock)
