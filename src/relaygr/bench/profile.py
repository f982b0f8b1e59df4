"""Model-only latency profile: prefill, full-pass ranking and cached ranking against length.

For a named model size, every (prefix length, candidate count) point is timed in isolation (one
user, no queueing): the prefill of the prefix, a ranking pass that recomputes the prefix (today's
production path) and a ranking pass from the cached prefix (the relay path), with or without
timestamps (the time bias). The same run measures the device's matmul peak and its element-wise
rate (score elements per second through bias add and SiLU), so each path is reported beside its
work (matrix FLOPs, score elements) as a fraction of the matmul peak and of its physical limit:
the time its FLOPs take at the peak plus its scores at the element-wise rate. The model is warmed
up first (``HSTU.warm_up``: the fused attention kernel compiles there), and the result names the
attention kernel that ran. The JSON it writes is what the trigger's latency cost model is fitted
on.

What the time bias costs is a ratio, and two runs on a shared machine can differ by more than it
(one speed drifted by half within an hour on the project's VM): ``time_bias_rounds`` times every
pass with and without timestamps in alternation, in this one process, and reports the median of
the rounds' ratios with their range (``TimeBiasCost``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from relaygr.bench.hardware import describe_device, elementwise_rate_gelems, matmul_peak_gflops
from relaygr.errors import ConfigError
from relaygr.model import HSTU, PrefixKV, config_for_size
from relaygr.model.flops import (
    prefill_flops,
    prefill_score_elements,
    rank_flops,
    rank_score_elements,
)
from relaygr.timing import synchronize, time_call

# The catalogue size does not change latency (one embedding row per token); this is large enough
# that id validation and lookups behave as in production.
PROFILE_NUM_ITEMS = 100_000


@dataclass(frozen=True)
class ProfileConfig:
    size: str = "small"
    prefix_lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    candidate_counts: tuple[int, ...] = (64, 256, 1024)
    suffix_tokens: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    repeats: int = 3
    seed: int = 0
    # Give every history and query a timestamp (gaps of up to a day, in time order), so the time
    # bias is part of every pass.
    timestamps: bool = False
    # HSTUConfig fields changed from the size's (e.g. the pass's block sizes, query_block and
    # score_block_elems, which are tuned for a CPU cache: a GPU may want them larger).
    model_overrides: Mapping[str, Any] = field(default_factory=dict)
    # Rounds of the time bias's cost (TimeBiasCost): each round times every pass of every point
    # once without and once with timestamps, in alternating order. 0: not measured.
    time_bias_rounds: int = 0

    def __post_init__(self) -> None:
        if not (self.prefix_lengths and self.candidate_counts
                and min(self.prefix_lengths) >= 1 and min(self.candidate_counts) >= 1):
            raise ConfigError("profile needs at least one prefix length and candidate count, "
                              "each >= 1")
        if self.suffix_tokens < 0 or self.repeats < 1 or self.time_bias_rounds < 0:
            raise ConfigError(f"profile needs suffix >= 0, repeats >= 1 and time-bias rounds "
                              f">= 0, got {self.suffix_tokens}, {self.repeats} and "
                              f"{self.time_bias_rounds}")


@dataclass(frozen=True)
class TimeBiasCost:
    """One pass at one point, with timestamps against without, timed in alternation: medians of
    each and the median of the rounds' ratios (timed / plain) with their range."""

    prefix_tokens: int
    candidates: int
    path: str                     # prefill, full or cached
    plain_ms: float
    timed_ms: float
    ratio: float
    ratio_min: float
    ratio_max: float
    rounds: int


@dataclass(frozen=True)
class ProfilePoint:
    prefix_tokens: int
    suffix_tokens: int
    candidates: int
    prefill_ms: float
    full_rank_ms: float
    cached_rank_ms: float
    speedup: float               # full_rank_ms / cached_rank_ms
    prefill_gflops: float        # achieved GFLOP/s of each path
    full_rank_gflops: float
    cached_rank_gflops: float
    cached_rank_page_faults: float = 0.0   # minor page faults per cached ranking call
    # The physical limit of each path on this device: its matmul FLOPs at the matmul peak plus
    # its attention scores at the element-wise rate (ProfileResult), as if neither overlapped.
    prefill_limit_ms: float = 0.0
    full_rank_limit_ms: float = 0.0
    cached_rank_limit_ms: float = 0.0
    # The work behind those limits: matmul FLOPs and attention score elements of each path.
    prefill_flops: int = 0
    full_rank_flops: int = 0
    cached_rank_flops: int = 0
    prefill_scores: int = 0
    full_rank_scores: int = 0
    cached_rank_scores: int = 0


@dataclass
class ProfileResult:
    config: ProfileConfig
    device: str
    dtype: str
    threads: int
    model: dict[str, object]
    matmul_peak_gflops: float
    host: str = ""
    points: list[ProfilePoint] = field(default_factory=list)
    elementwise_gelems: float = 0.0   # score elements per second (bias + SiLU), billions
    attention: str = ""               # the attention kernel that ran (HSTU.describe_attention)
    time_bias: list[TimeBiasCost] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {"device": self.device, "dtype": self.dtype, "threads": self.threads,
                "host": self.host, "model": self.model, "attention": self.attention,
                "matmul_peak_gflops": self.matmul_peak_gflops,
                "elementwise_gelems": self.elementwise_gelems,
                "config": asdict(self.config), "points": [asdict(p) for p in self.points],
                "time_bias": [asdict(c) for c in self.time_bias]}

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2))


def _gflops(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e9


def _timestamps(gen: torch.Generator, length: int) -> torch.Tensor:
    gaps = torch.randint(0, 86_400, (length,), generator=gen)
    return 1_600_000_000 + torch.cumsum(gaps, 0)


def run_profile(cfg: ProfileConfig, progress: object | None = None) -> ProfileResult:
    """Time every point of ``cfg``; ``progress`` is an optional ``rich.progress.Progress``."""
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    max_len = max(cfg.prefix_lengths) + cfg.suffix_tokens
    model_cfg = config_for_size(cfg.size, PROFILE_NUM_ITEMS, max_seq_len=max_len).with_(
        **cfg.model_overrides)
    torch.manual_seed(cfg.seed)
    model = HSTU(model_cfg).to(device=device, dtype=dtype).eval()
    attention = model.warm_up()
    result = ProfileResult(cfg, str(device), cfg.dtype, torch.get_num_threads(),
                           model_cfg.to_dict(), matmul_peak_gflops(device, dtype),
                           describe_device(device),
                           elementwise_gelems=elementwise_rate_gelems(device, dtype),
                           attention=attention)

    def limit_ms(flops: int, scores: int) -> float:
        return 1e3 * (flops / (result.matmul_peak_gflops * 1e9)
                      + scores / (result.elementwise_gelems * 1e9))

    gen = torch.Generator().manual_seed(cfg.seed)
    task = None
    if progress is not None:
        total = len(cfg.prefix_lengths) * len(cfg.candidate_counts)
        task = progress.add_task("profiling", total=total)  # type: ignore[attr-defined]
    s = cfg.suffix_tokens
    for n in cfg.prefix_lengths:
        items = torch.randint(1, PROFILE_NUM_ITEMS + 1, (n + s,), generator=gen)
        ts = _timestamps(gen, n + s) if cfg.timestamps else None
        prefix, prefix_ts = items[:n], (None if ts is None else ts[:n])
        prefill = time_call(partial(model.prefill, prefix, prefix_ts), device, cfg.repeats)
        kv = model.prefill(prefix, prefix_ts)
        work = {"prefill": (prefill_flops(model_cfg, n), prefill_score_elements(model_cfg, n))}
        for c in cfg.candidate_counts:
            cands = torch.randint(1, PROFILE_NUM_ITEMS + 1, (c,), generator=gen)
            calls = _passes(model, items, ts, n, cands, kv)
            full = time_call(calls["full"], device, cfg.repeats)
            cached = time_call(calls["cached"], device, cfg.repeats)
            work["full"] = (rank_flops(model_cfg, c, n, s, cached=False),
                            rank_score_elements(model_cfg, c, n, s, cached=False))
            work["cached"] = (rank_flops(model_cfg, c, n, s, cached=True),
                              rank_score_elements(model_cfg, c, n, s, cached=True))
            result.points.append(ProfilePoint(
                prefix_tokens=n, suffix_tokens=s, candidates=c,
                prefill_ms=prefill.median_ms, full_rank_ms=full.median_ms,
                cached_rank_ms=cached.median_ms, speedup=full.median_ms / cached.median_ms,
                prefill_gflops=_gflops(work["prefill"][0], prefill.median_ms),
                full_rank_gflops=_gflops(work["full"][0], full.median_ms),
                cached_rank_gflops=_gflops(work["cached"][0], cached.median_ms),
                cached_rank_page_faults=cached.page_faults_per_call,
                prefill_limit_ms=limit_ms(*work["prefill"]),
                full_rank_limit_ms=limit_ms(*work["full"]),
                cached_rank_limit_ms=limit_ms(*work["cached"]),
                prefill_flops=work["prefill"][0], full_rank_flops=work["full"][0],
                cached_rank_flops=work["cached"][0], prefill_scores=work["prefill"][1],
                full_rank_scores=work["full"][1], cached_rank_scores=work["cached"][1]))
            if progress is not None:
                progress.advance(task)  # type: ignore[attr-defined]
    if cfg.time_bias_rounds > 0:
        result.time_bias = time_bias_cost(model, cfg, device, gen)
    return result


def time_bias_cost(model: HSTU, cfg: ProfileConfig, device: torch.device,
                   gen: torch.Generator) -> list[TimeBiasCost]:
    """Every pass of every point of ``cfg`` with and without timestamps, ``time_bias_rounds``
    rounds in alternating order (module docstring)."""
    s = cfg.suffix_tokens
    costs = []
    for n in cfg.prefix_lengths:
        items = torch.randint(1, PROFILE_NUM_ITEMS + 1, (n + s,), generator=gen)
        ts = _timestamps(gen, n + s)
        for c in cfg.candidate_counts:
            cands = torch.randint(1, PROFILE_NUM_ITEMS + 1, (c,), generator=gen)
            calls = {timed: _passes(model, items, ts if timed else None, n, cands)
                     for timed in (False, True)}
            samples = _alternate(calls, cfg.time_bias_rounds, device)
            for path in calls[False]:
                plain, timed_ms = samples[(path, False)], samples[(path, True)]
                ratios = [t / p for t, p in zip(timed_ms, plain, strict=True)]
                costs.append(TimeBiasCost(n, c, path, statistics.median(plain),
                                          statistics.median(timed_ms),
                                          statistics.median(ratios), min(ratios), max(ratios),
                                          cfg.time_bias_rounds))
    return costs


def _passes(model: HSTU, items: torch.Tensor, ts: torch.Tensor | None, n: int,
            cands: torch.Tensor, kv: PrefixKV | None = None) -> dict[str, Callable[[], object]]:
    """The three passes over ``items`` (its first ``n`` the prefix, the rest the suffix), with
    the timestamps ``ts`` or none; ``kv``: the prefix's prefill, where the caller has it."""
    prefix, suffix = items[:n], (items[n:] if len(items) > n else None)
    prefix_ts = None if ts is None else ts[:n]
    suffix_ts = None if ts is None or suffix is None else ts[n:]
    query_ts = None if ts is None else int(ts[-1]) + 1
    kv = model.prefill(prefix, prefix_ts) if kv is None else kv
    return {"prefill": partial(model.prefill, prefix, prefix_ts),
            "full": partial(model.rank, cands, prefix_items=prefix, prefix_timestamps=prefix_ts,
                            suffix_items=suffix, suffix_timestamps=suffix_ts,
                            query_timestamp=query_ts),
            "cached": partial(model.rank, cands, prefix=kv, suffix_items=suffix,
                              suffix_timestamps=suffix_ts, query_timestamp=query_ts)}


def _alternate(calls: dict[bool, dict[str, Callable[[], object]]], rounds: int,
               device: torch.device) -> dict[tuple[str, bool], list[float]]:
    """Milliseconds of each call, ``rounds`` times, without and with timestamps in turn (which
    goes first alternates by round), after one warm-up call of each."""
    for fns in calls.values():
        for fn in fns.values():
            fn()
    samples: dict[tuple[str, bool], list[float]] = {}
    for r in range(rounds):
        for path in calls[False]:
            for timed in ((False, True) if r % 2 == 0 else (True, False)):
                synchronize(device)
                start = time.perf_counter()
                calls[timed][path]()
                synchronize(device)
                samples.setdefault((path, timed), []).append((time.perf_counter() - start) * 1e3)
    return samples
