"""Value types of a workload and the seeded samplers workloads are built from.

A ``Workload`` is what one measured point replays: the initial history of every user who visits
(what the history store is loaded with) and the open-loop request list. Histories are read-only
numpy arrays; requests are sorted by ``send_s``. Every sampler takes an explicit
``numpy.random.Generator``, so a workload is a pure function of its config, QPS, size and seed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Protocol

import numpy as np
from pydantic import PlainValidator

from relaygr.errors import ConfigError
from relaygr.settings import load


@dataclass(frozen=True)
class BenchRequest:
    """One user visit, sent open-loop at ``send_s``.

    ``recent_items`` are the behaviours since the user's previous visit: the ranking suffix of
    this visit. The cascade appends them to the user's history after ranking, so the user's next
    visit sees a prefix longer by ``len(recent_items)`` (and a new prefix version).
    ``request_ts`` (unix seconds) is present iff the visit is timed, and then
    ``recent_timestamps`` is too, non-decreasing and not after ``request_ts``.
    """

    request_id: int
    user_id: int
    send_s: float
    recent_items: tuple[int, ...]
    recent_timestamps: tuple[int, ...] | None
    request_ts: int | None
    num_candidates: int

# Unix time of the run start for generated timestamps (fixed so workloads are reproducible).
RUN_START_UNIX_S = 1_700_000_000


def readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class WorkloadHistory:
    """A user's behaviour history at the start of the run, oldest first.

    ``items`` are ids in 1..num_items; ``timestamps`` (unix s, non-decreasing) are present iff the
    user is timed. Both arrays are int64 and read-only.
    """

    items: np.ndarray
    timestamps: np.ndarray | None

    def __post_init__(self) -> None:
        assert self.items.ndim == 1 and self.items.dtype == np.int64
        assert self.timestamps is None or self.timestamps.shape == self.items.shape

    def __len__(self) -> int:
        return int(self.items.shape[0])

    @property
    def last_ts(self) -> int | None:
        if self.timestamps is None or not len(self):
            return None
        return int(self.timestamps[-1])


@dataclass(frozen=True)
class StageDelays:
    """Time the cascade's earlier stages take on their own fleets (the relay's first leg).

    A ranking request is due ``total_s`` after its visit was sent. Defaults: tens of ms each, a
    common budget for retrieval and coarse ranking inside a few-hundred-ms request.
    """

    retrieval_ms: float = 40.0
    preprocessing_ms: float = 30.0

    def __post_init__(self) -> None:
        if self.retrieval_ms < 0 or self.preprocessing_ms < 0:
            raise ConfigError("stage delays must be >= 0 ms")

    @property
    def total_s(self) -> float:
        return (self.retrieval_ms + self.preprocessing_ms) / 1e3


@dataclass(frozen=True, eq=False)
class Workload:
    """Initial histories plus the open-loop request list of one point.

    Invariants: ``requests`` are sorted by ``send_s`` with ids 0..n-1 in that order; every
    requested user has a history; item ids are in 1..``num_items``. ``params`` records the
    generator's settings for the report.
    """

    name: str
    num_items: int
    histories: Mapping[int, WorkloadHistory]
    requests: tuple[BenchRequest, ...]
    stage_delays: StageDelays
    qps: float
    seed: int
    params: Mapping[str, object] = field(default_factory=dict)

    def prefix_tokens_at_visit(self) -> np.ndarray:
        """Prefix length each request sees when earlier visits' events were appended first."""
        grown = {user: len(history) for user, history in self.histories.items()}
        out = np.empty(len(self.requests), dtype=np.int64)
        for i, request in enumerate(self.requests):
            out[i] = grown[request.user_id]
            grown[request.user_id] += len(request.recent_items)
        return out


class LengthDistribution(Protocol):
    """A policy drawing prefix lengths (tokens); ``describe`` names it and its parameters."""

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray: ...

    def describe(self) -> dict[str, object]: ...


@dataclass(frozen=True)
class FixedLength:
    """Every user exactly ``tokens`` long (the length sweep)."""

    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ConfigError(f"fixed length must be >= 1 token, got {self.tokens}")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.full(size, self.tokens, dtype=np.int64)

    def describe(self) -> dict[str, object]:
        return {"kind": "fixed", "tokens": self.tokens}


@dataclass(frozen=True)
class LogNormalLength:
    """Long-tailed lengths: exp(N(ln median, sigma)), rounded, clipped to [min, max]."""

    median: float = 2000.0
    sigma: float = 0.75     # ~3% of users reach the 8k clip at median 2000
    min_tokens: int = 32
    max_tokens: int = 8192

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.min_tokens <= self.max_tokens):
            raise ConfigError(f"invalid lognormal length distribution {self}")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        raw = np.exp(rng.normal(np.log(self.median), self.sigma, size))
        return np.clip(np.rint(raw), self.min_tokens, self.max_tokens).astype(np.int64)

    def describe(self) -> dict[str, object]:
        return {"kind": "lognormal", "median": self.median, "sigma": self.sigma,
                "min_tokens": self.min_tokens, "max_tokens": self.max_tokens}


@dataclass(frozen=True)
class TruncatedNormalLength:
    """N(mean, std) rounded, redrawn until inside [min, max] (true truncation, not clipping)."""

    mean: float
    std: float
    min_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        if not (self.std >= 0 and 1 <= self.min_tokens <= self.mean <= self.max_tokens):
            raise ConfigError(f"invalid truncated normal length distribution {self}")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        out = np.rint(rng.normal(self.mean, self.std, size))
        for _ in range(1000):
            bad = (out < self.min_tokens) | (out > self.max_tokens)
            if not bad.any():
                break
            out[bad] = np.rint(rng.normal(self.mean, self.std, int(bad.sum())))
        return np.clip(out, self.min_tokens, self.max_tokens).astype(np.int64)

    def describe(self) -> dict[str, object]:
        return {"kind": "truncated_normal", "mean": self.mean, "std": self.std,
                "min_tokens": self.min_tokens, "max_tokens": self.max_tokens}


def length_distribution(spec: Mapping[str, object]) -> LengthDistribution:
    """A length distribution chosen by ``spec["kind"]``; the other keys are its parameters."""
    kinds: dict[str, type] = {"fixed": FixedLength, "lognormal": LogNormalLength,
                              "truncated_normal": TruncatedNormalLength}
    params = dict(spec)
    kind = params.pop("kind", None)
    if kind not in kinds:
        raise ConfigError(f"unknown length distribution {kind!r}; choose one of {sorted(kinds)}")
    dist: LengthDistribution = load(kinds[str(kind)], params)
    return dist


def _as_length_distribution(value: object) -> LengthDistribution:
    """A configuration's length distribution: a mapping becomes one (``length_distribution``),
    a distribution is kept as it is."""
    if isinstance(value, Mapping):
        return length_distribution(value)
    if not (callable(getattr(value, "sample", None)) and callable(getattr(value, "describe",
                                                                          None))):
        raise ConfigError("a length distribution is given as a mapping with its kind, e.g. "
                          f"{{'kind': 'fixed', 'tokens': 512}}, got {type(value).__name__}")
    return value  # type: ignore[return-value]


# A configuration field holding a length distribution: ``settings.load`` builds it from its
# mapping ``{"kind": ..., **parameters}``.
LengthSpec = Annotated[LengthDistribution, PlainValidator(_as_length_distribution)]


class ZipfSampler:
    """Ids 1..n with P(popularity rank k) proportional to k^-s over a finite support.

    Ranks map to ids through a permutation seeded by ``seed`` (so popularity is not id order);
    ``id_of_rank`` exposes it. Sampling is inverse-CDF, exact for any ``s >= 0``.
    """

    def __init__(self, n: int, s: float, seed: int | Sequence[int]) -> None:
        if n < 1 or s < 0:
            raise ConfigError(f"Zipf needs n >= 1 and s >= 0, got n={n}, s={s}")
        self.n, self.s = n, s
        weights = np.arange(1, n + 1, dtype=np.float64) ** -s
        self._cdf = np.cumsum(weights) / weights.sum()
        self.id_of_rank = readonly(np.random.default_rng(seed).permutation(n).astype(np.int64) + 1)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        ranks = np.searchsorted(self._cdf, rng.random(size), side="right")
        return self.id_of_rank[np.minimum(ranks, self.n - 1)]

    def probability_of_rank(self, rank: int) -> float:
        """P(rank), 1-based."""
        lower = self._cdf[rank - 2] if rank > 1 else 0.0
        return float(self._cdf[rank - 1] - lower)


def poisson_send_times(rng: np.random.Generator, qps: float, count: int) -> np.ndarray:
    """Open-loop arrival times (s): exponential gaps of mean 1/qps, the first after one gap."""
    if not qps > 0 or count < 1:
        raise ConfigError(f"need qps > 0 and count >= 1, got qps={qps}, count={count}")
    return np.cumsum(rng.exponential(1.0 / qps, count))


def history_timestamps(rng: np.random.Generator, length: int, mean_gap_s: float,
                       end_before_s: int) -> np.ndarray:
    """Non-decreasing unix times for ``length`` events ending shortly before ``end_before_s``."""
    gaps = rng.exponential(mean_gap_s, length)
    ends = end_before_s - np.cumsum(gaps)[::-1]
    return np.floor(ends).astype(np.int64)
