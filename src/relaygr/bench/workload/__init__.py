"""Benchmark workloads: who visits when, with which history (see docs/benchmark.md).

Three sources, chosen by name in ``workload_builder``: ``synthetic`` (Zipf users and items,
long-tailed or fixed prefix lengths, short-gap revisits), ``ml1m`` (MovieLens-1M replay) and
``dlrmv3`` (the MLPerf Inference DLRMv3 profile, scalable for CPU). A ``WorkloadBuilder`` turns
(QPS, number of requests) into a ``Workload``, deterministically from its seed.

Appended events: a visit's ``recent_items`` are the behaviours since the user's previous visit.
The cascade appends them to the history store after ranking, so the next visit of that user sees
a longer prefix with a new version. No events are appended any other way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from relaygr.bench.workload.base import (
    FixedLength,
    LengthDistribution,
    LogNormalLength,
    StageDelays,
    TruncatedNormalLength,
    Workload,
    WorkloadHistory,
    ZipfSampler,
    length_distribution,
    poisson_send_times,
)
from relaygr.bench.workload.dlrmv3 import DLRMv3Config, DLRMv3Workload
from relaygr.bench.workload.ml1m import ML1MConfig, ML1MWorkload, read_ml1m
from relaygr.bench.workload.summary import Spread, WorkloadSummary, summarize
from relaygr.bench.workload.synthetic import SyntheticConfig, SyntheticWorkload
from relaygr.errors import ConfigError


class WorkloadBuilder(Protocol):
    """Builds the workload of one point; the same (qps, num_requests) always gives the same."""

    name: str

    def build(self, qps: float, num_requests: int) -> Workload: ...

    def describe(self) -> dict[str, object]: ...


def workload_builder(source: str, params: Mapping[str, Any] | None = None,
                     seed: int = 0) -> WorkloadBuilder:
    """The builder of ``source`` ("synthetic", "ml1m", "dlrmv3") with config ``params``."""
    params = params or {}
    if source == "synthetic":
        return SyntheticWorkload(SyntheticConfig.from_dict(params), seed)
    if source == "ml1m":
        return ML1MWorkload(ML1MConfig.from_dict(params), seed)
    if source == "dlrmv3":
        return DLRMv3Workload(DLRMv3Config.from_dict(params), seed)
    raise ConfigError(f"unknown workload source {source!r}; choose synthetic, ml1m or dlrmv3")


__all__ = [
    "DLRMv3Config",
    "DLRMv3Workload",
    "FixedLength",
    "LengthDistribution",
    "LogNormalLength",
    "ML1MConfig",
    "ML1MWorkload",
    "Spread",
    "StageDelays",
    "SyntheticConfig",
    "SyntheticWorkload",
    "TruncatedNormalLength",
    "Workload",
    "WorkloadBuilder",
    "WorkloadHistory",
    "WorkloadSummary",
    "ZipfSampler",
    "length_distribution",
    "poisson_send_times",
    "read_ml1m",
    "summarize",
    "workload_builder",
]
