"""MovieLens-1M replay: real users, real item sequences and lengths, real timestamps.

``read_ml1m`` is the one place that reads the file (the ``ratings_ordered.csv.gz`` layout of
``../shared/datasets/ml-1m``); swap it for ``relaygr.data``'s loader when that lands. Movie ids are
remapped densely to 1..K in ascending id order. Users 1-2999 are timed; 3000-6040 have no
timestamps in that file, so their requests are untimed (``timed_only`` keeps the timed ones).

Replay: each eligible user (at least ``min_prefix_tokens`` + V * E events) holds out its last
V * E events; the rest is its initial history. Its V visits (``visits_per_user``) carry the held-out
events in order, E (``events_per_visit``) per visit, so the store grows back to the real sequence.
Visiting users are a seeded random subset, interleaved uniformly over the Poisson slots; a timed
visit's request time is the time of its last event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from relaygr.bench.workload.base import (
    StageDelays,
    Workload,
    WorkloadHistory,
    poisson_send_times,
    readonly,
)
from relaygr.bench.workload.schedule import FixedVisitsAssigner, VisitEvents, assemble
from relaygr.errors import ConfigError
from relaygr.settings import load

# src/relaygr/bench/workload/ml1m.py -> the checkout's parent holds shared/datasets.
DEFAULT_PATH = (Path(__file__).resolve().parents[4].parent
                / "shared" / "datasets" / "ml-1m" / "ratings_ordered.csv.gz")
_SCHEDULE = 0


def movie_ids(movies: np.ndarray) -> np.ndarray:
    """The dataset's movie id of every dense item id: ``movie_ids(...)[i]`` is item ``i + 1``
    (ascending, as ``relaygr.data.IdMap`` numbers them)."""
    return np.sort(np.unique(np.asarray(movies, dtype=np.int64)))


def read_movie_ids(path: Path) -> np.ndarray:
    """``movie_ids`` of the file ``read_ml1m`` reads: what the replay's item ids name."""
    if not path.is_file():
        raise ConfigError(f"MovieLens-1M ratings not found at {path}")
    return movie_ids(pd.read_csv(path, usecols=["movie_id"])["movie_id"].to_numpy())


@lru_cache(maxsize=2)
def read_ml1m(path: Path) -> tuple[dict[int, WorkloadHistory], int]:
    """Every user's full sequence (dense item ids, timestamps or None) and the catalogue size."""
    if not path.is_file():
        raise ConfigError(f"MovieLens-1M ratings not found at {path}")
    frame = pd.read_csv(path, usecols=["user_id", "movie_id", "timestamp", "seq_pos"],
                        dtype={"user_id": "int64", "movie_id": "int64", "timestamp": "float64",
                               "seq_pos": "int64"})  # float: missing timestamps read as NaN
    frame = frame.sort_values(["user_id", "seq_pos"], kind="stable")
    movies = movie_ids(frame["movie_id"].to_numpy())
    items = np.searchsorted(movies, frame["movie_id"].to_numpy()).astype(np.int64) + 1
    stamps = frame["timestamp"].to_numpy()
    users = frame["user_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], len(users)]
    histories = {}
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        part = stamps[start:end]
        timed = not np.isnan(part).any()
        histories[int(users[start])] = WorkloadHistory(
            readonly(items[start:end].copy()),
            readonly(part.astype(np.int64)) if timed else None)
    return histories, len(movies)


@dataclass(frozen=True)
class ML1MConfig:
    """How the replay splits real sequences into an initial history and visits."""

    path: Path = DEFAULT_PATH
    visits_per_user: int = 4
    events_per_visit: int = 8
    min_prefix_tokens: int = 16
    num_candidates: int = 256
    timed_only: bool = False
    stage_delays: StageDelays = field(default_factory=StageDelays)

    def __post_init__(self) -> None:
        if min(self.visits_per_user, self.events_per_visit, self.min_prefix_tokens,
               self.num_candidates) < 1:
            raise ConfigError("ML1MConfig counts must be >= 1")

    @property
    def held_out(self) -> int:
        return self.visits_per_user * self.events_per_visit

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["path"] = str(self.path)
        out["stage_delays"] = {"retrieval_ms": self.stage_delays.retrieval_ms,
                               "preprocessing_ms": self.stage_delays.preprocessing_ms}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ML1MConfig:
        return load(cls, data)


class ML1MPopulation:
    """Replayed users: initial history = the sequence minus its held-out tail."""

    def __init__(self, config: ML1MConfig) -> None:
        self.config = config
        self.sequences, self.num_items = read_ml1m(config.path)
        need = config.min_prefix_tokens + config.held_out
        self.eligible = np.array(sorted(
            u for u, h in self.sequences.items()
            if len(h) >= need and (h.timestamps is not None or not config.timed_only)),
            dtype=np.int64)

    def history(self, user_id: int) -> WorkloadHistory:
        full = self.sequences[user_id]
        cut = len(full) - self.config.held_out
        stamps = None if full.timestamps is None else full.timestamps[:cut]
        return WorkloadHistory(full.items[:cut], stamps)

    def visit_events(self, user_id: int, visit_index: int, send_s: float,
                     prev_ts: int | None) -> VisitEvents:
        full = self.sequences[user_id]
        start = len(full) - self.config.held_out + visit_index * self.config.events_per_visit
        window = slice(start, start + self.config.events_per_visit)
        if full.timestamps is None:
            return VisitEvents(full.items[window], None, None)
        stamps = full.timestamps[window]
        return VisitEvents(full.items[window], stamps, int(stamps[-1]))


class ML1MWorkload:
    """Builds ML-1M replay workloads at any QPS and size (a ``WorkloadBuilder``)."""

    name = "ml1m"

    def __init__(self, config: ML1MConfig | None = None, seed: int = 0) -> None:
        self.config = config or ML1MConfig()
        self.seed = seed
        self.population = ML1MPopulation(self.config)

    def build(self, qps: float, num_requests: int) -> Workload:
        rng = np.random.default_rng([self.seed, _SCHEDULE])
        send_s = poisson_send_times(rng, qps, num_requests)
        order = rng.permutation(self.population.eligible)
        users = FixedVisitsAssigner(order, self.config.visits_per_user).assign(send_s, rng)
        return assemble(self.name, self.population, users, send_s, self.population.num_items,
                        self.config.num_candidates, self.config.stage_delays, qps, self.seed,
                        self.describe())

    def describe(self) -> dict[str, object]:
        return {"source": self.name, "seed": self.seed, "num_items": self.population.num_items,
                "eligible_users": len(self.population.eligible), **self.config.describe()}

