"""The synthetic workload: Zipf users and items, long-tailed prefixes, short-gap revisits.

Who visits: Zipf(``user_zipf_s``) over ``num_users``, capped at ``max_visits_per_user`` visits
each, plus short-gap sessions for ``short_gap_share`` of the users (see
``ZipfRevisitAssigner``). What they carry: an initial prefix of a length drawn per user from
``prefix_len`` (default lognormal, median 2,000, clipped to [32, 8192]; ``FixedLength`` for the
length sweep) of Zipf(``item_zipf_s``) items, and per visit ``1 + Poisson(recent_events_mean - 1)``
new Zipf items (the ranking suffix, appended to the history after ranking). Timed by default.
Each user's history and visits come from generators seeded by (seed, user[, visit]), so a user is
the same across QPS trials and modes; the arrival pattern at every QPS is the same exponential
draws scaled by 1/QPS (common random numbers across a search).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from relaygr.bench.workload.base import (
    RUN_START_UNIX_S,
    FixedLength,
    LengthSpec,
    LogNormalLength,
    StageDelays,
    Workload,
    WorkloadHistory,
    ZipfSampler,
    history_timestamps,
    poisson_send_times,
    readonly,
)
from relaygr.bench.workload.schedule import VisitEvents, ZipfRevisitAssigner, assemble
from relaygr.errors import ConfigError
from relaygr.settings import load

_HISTORY, _VISIT, _SCHEDULE, _ITEMS, _USERS, _SHORT = range(6)  # seed stream tags


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of the synthetic population (defaults are the documented mixed workload)."""

    num_users: int = 5000
    num_items: int = 50_000
    user_zipf_s: float = 0.9          # a few heavy users, a long tail of occasional ones
    item_zipf_s: float = 1.0          # classic catalogue skew
    prefix_len: LengthSpec = field(default_factory=LogNormalLength)
    recent_events_mean: float = 16.0  # new behaviours per visit (the ranking suffix)
    num_candidates: int = 512         # "hundreds" after pre-processing
    short_gap_share: float = 0.3      # users who refresh / paginate within seconds
    short_gap_mean_s: float = 5.0
    session_visits: int = 4           # visits in one short-gap session
    max_visits_per_user: int | None = 8  # bounds prefix growth from appended events
    timed: bool = True
    history_gap_mean_s: float = 3600.0   # mean gap between historical events
    stage_delays: StageDelays = field(default_factory=StageDelays)

    def __post_init__(self) -> None:
        if self.num_users < 1 or self.num_items < 1 or self.num_candidates < 1:
            raise ConfigError("num_users, num_items and num_candidates must be >= 1")
        if not 0.0 <= self.short_gap_share <= 1.0:
            raise ConfigError(f"short_gap_share must be in [0, 1], got {self.short_gap_share}")
        if self.recent_events_mean < 1 or self.history_gap_mean_s <= 0:
            raise ConfigError("recent_events_mean must be >= 1 and history_gap_mean_s > 0")

    def with_fixed_length(self, tokens: int) -> SyntheticConfig:
        return replace(self, prefix_len=FixedLength(tokens))

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["prefix_len"] = self.prefix_len.describe()
        out["stage_delays"] = {"retrieval_ms": self.stage_delays.retrieval_ms,
                               "preprocessing_ms": self.stage_delays.preprocessing_ms}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyntheticConfig:
        return load(cls, data)


class SyntheticPopulation:
    """Users of a ``SyntheticConfig``: histories and visits seeded per user."""

    def __init__(self, config: SyntheticConfig, seed: int) -> None:
        self.config, self.seed = config, seed
        self.items = ZipfSampler(config.num_items, config.item_zipf_s, seed=[seed, _ITEMS])

    def history(self, user_id: int) -> WorkloadHistory:
        rng = np.random.default_rng([self.seed, _HISTORY, user_id])
        length = int(self.config.prefix_len.sample(rng, 1)[0])
        items = self.items.sample(rng, length)
        timestamps = None
        if self.config.timed:
            end = RUN_START_UNIX_S - int(rng.exponential(self.config.history_gap_mean_s))
            timestamps = readonly(history_timestamps(rng, length,
                                                     self.config.history_gap_mean_s, end))
        return WorkloadHistory(readonly(items), timestamps)

    def visit_events(self, user_id: int, visit_index: int, send_s: float,
                     prev_ts: int | None) -> VisitEvents:
        rng = np.random.default_rng([self.seed, _VISIT, user_id, visit_index])
        count = 1 + int(rng.poisson(self.config.recent_events_mean - 1))
        items = self.items.sample(rng, count)
        if not self.config.timed:
            return VisitEvents(items, None, None)
        request_ts = RUN_START_UNIX_S + int(send_s)
        low = request_ts if prev_ts is None else min(prev_ts, request_ts)
        stamps = np.sort(rng.integers(low, request_ts + 1, count)).astype(np.int64)
        return VisitEvents(items, stamps, request_ts)


class SyntheticWorkload:
    """Builds synthetic workloads at any QPS and size (a ``WorkloadBuilder``)."""

    name = "synthetic"

    def __init__(self, config: SyntheticConfig | None = None, seed: int = 0) -> None:
        self.config = config or SyntheticConfig()
        self.seed = seed
        self.population = SyntheticPopulation(self.config, seed)
        self.users = ZipfSampler(self.config.num_users, self.config.user_zipf_s,
                                 seed=[seed, _USERS])
        short_rng = np.random.default_rng([seed, _SHORT])
        self.short_gap = short_rng.random(self.config.num_users + 1) < self.config.short_gap_share

    def build(self, qps: float, num_requests: int) -> Workload:
        rng = np.random.default_rng([self.seed, _SCHEDULE])
        send_s = poisson_send_times(rng, qps, num_requests)
        assigner = ZipfRevisitAssigner(self.users, self.short_gap, self.config.short_gap_mean_s,
                                       self.config.session_visits,
                                       self.config.max_visits_per_user)
        users = assigner.assign(send_s, rng)
        return assemble(self.name, self.population, users, send_s, self.config.num_items,
                        self.config.num_candidates, self.config.stage_delays, qps, self.seed,
                        self.describe())

    def describe(self) -> dict[str, object]:
        return {"source": self.name, "seed": self.seed, **self.config.describe()}
