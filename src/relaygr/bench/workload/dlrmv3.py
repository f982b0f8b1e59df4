"""The MLPerf Inference DLRMv3 profile (an HSTU ranking benchmark), optionally scaled for CPU.

Public definition followed: HSTU with 5 layers, dim 512, 4 heads of 128; one query is one user
history plus 2,048 candidates; the history length at query time has mean 6,716, std 531,
min 4,450, max 9,080; each user returns about 7 times over the run with about 100 new events
(~1.5% of the history) per visit; ranking P99 bound 80 ms.

How we generate it: users 1..ceil(n/7) each visit ``visits_per_user`` times in a uniformly random
interleaving of the Poisson arrival slots. A user's initial prefix length L0 is a truncated
normal chosen so that the history at query time, ``L0 + (k + 1) * E`` at visit k (prefix plus the
visit's E new events), has the published mean and std over the visits
(mean(L0) = 6716 - E (V + 1) / 2, var(L0) = 531^2 - E^2 (V^2 - 1) / 12) and stays inside
[4450, 9080] (L0 is truncated to [4450 - E, 9080 - V E]). Items are Zipf over ``num_items``.

``scale`` shrinks every length (mean, std, min, max, events per visit) and the candidate count
by the same factor, rounding to whole tokens; ``dim_scale`` shrinks the model width (heads stay
4, so head_dim shrinks too); layers stay 5. The SLO stays 80 ms: the scaled profile exists so a
CPU sits in the same regime (full recompute near or over the bound) as a GPU at full size.
``DLRMv3Config.cpu()`` is scale 1/8 (mean history 840 tokens, 12 events per visit, 256
candidates) and dim 128: a full-recompute query is 2.4 GFLOP instead of 490 (about 1/200;
``relaygr.model.flops.rank_flops``), tens of ms on 2 cores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from relaygr.bench.workload.base import (
    RUN_START_UNIX_S,
    StageDelays,
    TruncatedNormalLength,
    Workload,
    WorkloadHistory,
    ZipfSampler,
    history_timestamps,
    poisson_send_times,
    readonly,
)
from relaygr.bench.workload.schedule import FixedVisitsAssigner, VisitEvents, assemble
from relaygr.errors import ConfigError
from relaygr.settings import load

# The published profile (MLPerf Inference DLRMv3).
HISTORY_MEAN, HISTORY_STD, HISTORY_MIN, HISTORY_MAX = 6716, 531, 4450, 9080
CANDIDATES, EVENTS_PER_VISIT, VISITS_PER_USER = 2048, 100, 7
NUM_LAYERS, DIM, NUM_HEADS = 5, 512, 4
RANKING_P99_MS = 80.0

_HISTORY, _VISIT, _SCHEDULE, _ITEMS = range(4)


@dataclass(frozen=True)
class DLRMv3Config:
    """The DLRMv3 profile at ``scale`` (1.0 = the published sizes)."""

    scale: float = 1.0
    dim_scale: float = 1.0
    visits_per_user: int = VISITS_PER_USER
    num_items: int = 1_000_000     # our choice: the public text fixes no catalogue size here
    item_zipf_s: float = 1.0
    timed: bool = True
    history_gap_mean_s: float = 3600.0
    stage_delays: StageDelays = field(default_factory=StageDelays)

    def __post_init__(self) -> None:
        if not 0 < self.scale <= 1 or not 0 < self.dim_scale <= 1:
            raise ConfigError("DLRMv3 scale and dim_scale must be in (0, 1]")
        if self.visits_per_user < 1 or self.num_items < 1:
            raise ConfigError("visits_per_user and num_items must be >= 1")

    @classmethod
    def cpu(cls) -> DLRMv3Config:
        """The CPU profile: lengths and candidates x 1/8, dim 512 -> 128."""
        return cls(scale=1 / 8, dim_scale=1 / 4, num_items=100_000)

    def scaled(self, value: float) -> int:
        return max(1, round(value * self.scale))

    @property
    def events_per_visit(self) -> int:
        return self.scaled(EVENTS_PER_VISIT)

    @property
    def num_candidates(self) -> int:
        return self.scaled(CANDIDATES)

    def history_at_query(self) -> dict[str, int]:
        """Target mean/std/min/max of the history length at query time, in tokens."""
        return {"mean": self.scaled(HISTORY_MEAN), "std": self.scaled(HISTORY_STD),
                "min": self.scaled(HISTORY_MIN), "max": self.scaled(HISTORY_MAX)}

    def initial_prefix(self) -> TruncatedNormalLength:
        """L0 such that L0 + (k + 1) E over visits k has the target moments (module doc)."""
        target, e, v = self.history_at_query(), self.events_per_visit, self.visits_per_user
        spread = e * e * (v * v - 1) / 12
        std = math.sqrt(max(target["std"] ** 2 - spread, 0.0))
        low, high = target["min"] - e, target["max"] - v * e
        if low < 1 or high < low:
            raise ConfigError(f"DLRMv3 scale {self.scale} leaves no room for {v} visits")
        return TruncatedNormalLength(target["mean"] - e * (v + 1) / 2, std, low, high)

    def model_shape(self) -> dict[str, int]:
        """The HSTU shape the profile prescribes at this ``dim_scale``."""
        dim = max(NUM_HEADS, round(DIM * self.dim_scale / NUM_HEADS) * NUM_HEADS)
        return {"num_layers": NUM_LAYERS, "dim": dim, "num_heads": NUM_HEADS}

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stage_delays"] = {"retrieval_ms": self.stage_delays.retrieval_ms,
                               "preprocessing_ms": self.stage_delays.preprocessing_ms}
        out.update(events_per_visit=self.events_per_visit, num_candidates=self.num_candidates,
                   history_at_query=self.history_at_query(), model_shape=self.model_shape(),
                   ranking_p99_ms=RANKING_P99_MS)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DLRMv3Config:
        return load(cls, data)


class DLRMv3Population:
    """Users of the profile: truncated-normal prefixes, fixed-size visits, Zipf items."""

    def __init__(self, config: DLRMv3Config, seed: int) -> None:
        self.config, self.seed = config, seed
        self.items = ZipfSampler(config.num_items, config.item_zipf_s, seed=[seed, _ITEMS])
        self.prefix_len = config.initial_prefix()

    def history(self, user_id: int) -> WorkloadHistory:
        rng = np.random.default_rng([self.seed, _HISTORY, user_id])
        length = int(self.prefix_len.sample(rng, 1)[0])
        items = readonly(self.items.sample(rng, length))
        if not self.config.timed:
            return WorkloadHistory(items, None)
        end = RUN_START_UNIX_S - int(rng.exponential(self.config.history_gap_mean_s))
        return WorkloadHistory(items, readonly(
            history_timestamps(rng, length, self.config.history_gap_mean_s, end)))

    def visit_events(self, user_id: int, visit_index: int, send_s: float,
                     prev_ts: int | None) -> VisitEvents:
        rng = np.random.default_rng([self.seed, _VISIT, user_id, visit_index])
        count = self.config.events_per_visit
        items = self.items.sample(rng, count)
        if not self.config.timed:
            return VisitEvents(items, None, None)
        request_ts = RUN_START_UNIX_S + int(send_s)
        low = request_ts if prev_ts is None else min(prev_ts, request_ts)
        return VisitEvents(items, np.sort(rng.integers(low, request_ts + 1, count)), request_ts)


class DLRMv3Workload:
    """Builds DLRMv3-profile workloads at any QPS and size (a ``WorkloadBuilder``)."""

    name = "dlrmv3"

    def __init__(self, config: DLRMv3Config | None = None, seed: int = 0) -> None:
        self.config = config or DLRMv3Config()
        self.seed = seed
        self.population = DLRMv3Population(self.config, seed)

    def build(self, qps: float, num_requests: int) -> Workload:
        rng = np.random.default_rng([self.seed, _SCHEDULE])
        send_s = poisson_send_times(rng, qps, num_requests)
        num_users = -(-num_requests // self.config.visits_per_user)
        users = FixedVisitsAssigner(np.arange(1, num_users + 1, dtype=np.int64),
                                    self.config.visits_per_user).assign(send_s, rng)
        return assemble(self.name, self.population, users, send_s, self.config.num_items,
                        self.config.num_candidates, self.config.stage_delays, qps, self.seed,
                        self.describe())

    def describe(self) -> dict[str, object]:
        return {"source": self.name, "seed": self.seed, **self.config.describe()}
