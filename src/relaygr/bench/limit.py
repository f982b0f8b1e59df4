"""The physical limit: what ranking a cached request costs with nothing else in the way.

A ``LimitProbe`` (supplied by whoever owns the model, e.g. the profiler) times the model's cached
ranking pass in isolation: no queueing, no cache bookkeeping, no event loop. The benchmark sets
the relay's low-load P50 ranking latency against its median (``relay_overhead_ratio``), and turns
it into achieved FLOP/s with ``relaygr.model.flops.rank_flops`` against the measured matmul peak.

The ratio comes with an interval (``relay_overhead_low``/``_high``): each median's
distribution-free 95% interval from order statistics (``stats.quantile_ci_ranks``; 20 relayed
requests: the 6th to 15th smallest; 25 isolated passes: the 8th to 18th), the low end the
latency's low over the pass's high, the high end the other way round (both hold together with
probability at least 0.9). Both medians move between runs on a shared 2-vCPU VM (the isolated
pass by up to 1.5x: docs/runs/2026-11-27-relay-overhead-taken-apart.md), so a verdict needs
their spread, not one quotient of two medians.

Every ``LimitProbe`` times the pass as the relay's low-load requests arrive: each timed pass
after ``LIMIT_PACE_S`` of idling. A pass that follows an idle gap is slower than one straight
after another (caches, TLB and the core's own state go cold): on the 2-core AMD EPYC box, the
cpu profile's 2,049-token cached pass, gaps interleaved, P50 9.6 ms back to back, 10.3 after
10 ms idle, 10.75 after 100 ms, 10.7 after 1 s. The limit point sends one request a second, so
the relay's compute pays that; a denominator timed back to back would charge the machine's cold
pass to the relay's overhead. 0.1 s already costs what a second does there, for a tenth of the
probe's time (2.5 s for 25 timed passes).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import torch

from relaygr.bench.report import LimitReport, ratio
from relaygr.bench.stats import PointStats, quantile_ci_ranks
from relaygr.model import HSTU, HSTUConfig
from relaygr.model.flops import rank_flops
from relaygr.model.inputs import RankInput
from relaygr.timing import time_call

LIMIT_PACE_S = 0.1
# The overhead's interval is as wide as the wider of its two medians' intervals allows: the pass
# alone is timed as often as the limit point has requests, and at least this often (a 5-call
# median of the cpu profile's 2,048-token pass ranged 11.0-17.1 ms across runs on the shared
# 2-core box; 25 calls take 0.4 s, plus their idle gaps).
MIN_ISOLATED_PASSES = 25


def isolated_passes(requests: int) -> int:
    """How many isolated passes a limit point of ``requests`` requests is set against."""
    return max(MIN_ISOLATED_PASSES, requests)


class LimitProbe(Protocol):
    """Times the model alone."""

    def cached_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                               passes: int) -> list[float]:
        """Ms of each of ``passes`` timed cached ranking passes (prefix K/V given; suffix +
        candidates computed), each after an idle gap (module docstring)."""
        ...


def median_interval(samples: Sequence[float]) -> tuple[float, float] | None:
    """The median's distribution-free 95% interval of non-negative ``samples`` (0 and inf:
    too few samples to bound it below and above); None: no samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    lo, hi = quantile_ci_ranks(len(ordered), 0.5)
    return (0.0 if lo is None else ordered[lo - 1]), (math.inf if hi is None else ordered[hi - 1])


class ModelLimitProbe:
    """Times ``model.rank`` on random items (timed histories unless ``timed=False``, like the
    workloads), on the calling thread's torch threads.

    ``cached_rank_ms``: the prefix K/V is computed once per call, outside the timed region; the
    timed call computes the suffix and the candidates against it, exactly the relay's ranking
    leg. ``full_rank_ms`` and ``full_rank_samples_ms`` (a ``relaygr.bench.operating.CostProbe``):
    the timed call computes prefix, suffix and candidates of ``batch`` users (the samples: one)
    in one model call, the baseline's pass.
    """

    def __init__(self, model: HSTU, seed: int = 0, timed: bool = True, full_repeats: int = 9,
                 pace_s: float = LIMIT_PACE_S) -> None:
        self.model, self.timed, self.pace_s = model, timed, pace_s
        # the cost curve's points: a few calls each (tens of ms each near the operating point)
        self.full_repeats = full_repeats
        self._gen = torch.Generator().manual_seed(seed)

    def _times(self, count: int, start: int) -> torch.Tensor | None:
        # one event a minute: the time-bucket bias costs the same for any spacing
        return start + 60 * torch.arange(count) if self.timed and count else None

    def _items(self, count: int) -> torch.Tensor:
        return torch.randint(1, self.model.cfg.num_items + 1, (count,), generator=self._gen)

    def cached_pass(self, prefix_tokens: int, suffix_tokens: int, candidates: int
                    ) -> Callable[[], object]:
        """A cached ranking pass on random items, ready to time: the prefix K/V computed here,
        once, outside whatever times the call."""
        kv = self.model.prefill(self._items(prefix_tokens), self._times(prefix_tokens, 10**9))
        suffix = self._items(suffix_tokens) if suffix_tokens else None
        suffix_ts = self._times(suffix_tokens, 10**9 + 60 * prefix_tokens)
        return partial(self.model.rank, self._items(candidates), prefix=kv,
                       suffix_items=suffix, suffix_timestamps=suffix_ts)

    def cached_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                               passes: int) -> list[float]:
        call = self.cached_pass(prefix_tokens, suffix_tokens, candidates)
        return list(time_call(call, self.model.device, repeats=passes,
                              pace_s=self.pace_s).samples_ms)

    def full_pass_inputs(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                         batch: int = 1) -> list[RankInput]:
        """``batch`` users' full ranking passes on random items (one model call's input)."""
        return [RankInput(
            self._items(candidates), prefix_items=self._items(prefix_tokens),
            prefix_timestamps=self._times(prefix_tokens, 10**9),
            suffix_items=self._items(suffix_tokens) if suffix_tokens else None,
            suffix_timestamps=self._times(suffix_tokens, 10**9 + 60 * prefix_tokens))
            for _ in range(batch)]

    def full_rank_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                     batch: int = 1) -> float:
        requests = self.full_pass_inputs(prefix_tokens, suffix_tokens, candidates, batch)
        call = partial(self.model.rank_batch, requests)
        # two warm-up calls: the first of a new length allocates its buffers
        return time_call(call, self.model.device, repeats=self.full_repeats, warmup=2).median_ms

    def full_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                             passes: int) -> list[float]:
        call = partial(self.model.rank_batch,
                       self.full_pass_inputs(prefix_tokens, suffix_tokens, candidates))
        return list(time_call(call, self.model.device, repeats=passes, warmup=2).samples_ms)


def limit_report(low_load: PointStats, probe: LimitProbe | None, model: HSTUConfig | None,
                 peak_gflops: float | None, prefix_len: int, suffix_tokens: int,
                 candidates: int, relayed_parts: dict[str, object] | None = None,
                 compute_by_path: dict[str, dict[str, float]] | None = None,
                 relayed_latencies_ms: Sequence[float] = (),
                 passes: int = MIN_ISOLATED_PASSES) -> LimitReport:
    """Combine the low-load point, the isolated timing (``passes`` passes) and the FLOP count.

    The low-load latency is over the requests that took the relay path (ranked from a cached
    prefix), the path the isolated pass measures; the point's other requests (a prefix the
    trigger left to the full pass) are in ``low_load_p99_ms``, which covers the whole point.
    ``relayed_parts`` is ``stats.latency_parts`` over those same relayed requests, and
    ``compute_by_path`` their ``stats.compute_by_path``; ``relayed_latencies_ms`` their ranking
    latencies (the overhead's interval; none: no interval). With no relayed request the
    overhead is not measured: the point's other requests are full passes, not the relay's."""
    samples = ([] if probe is None
               else probe.cached_rank_samples_ms(prefix_len, suffix_tokens, candidates, passes))
    isolated_ms = statistics.median(samples) if samples else None
    relayed = low_load.ranking_relayed
    p50_ms = relayed.p50_ms if relayed.count else low_load.ranking.p50_ms
    low = high = None
    latency, isolated = median_interval(relayed_latencies_ms), median_interval(samples)
    if latency is not None and isolated is not None and isolated[0] > 0:
        low, high = latency[0] / isolated[1], latency[1] / isolated[0]
    achieved = None
    if model is not None and isolated_ms is not None and isolated_ms > 0:
        flops = rank_flops(model, candidates, prefix_len, suffix_tokens, cached=True)
        achieved = flops / (isolated_ms * 1e-3) / 1e9
    return LimitReport(
        mode=low_load.mode, qps=low_load.qps, prefix_len=prefix_len,
        suffix_tokens=suffix_tokens, candidates=candidates,
        cached_rank_ms_isolated=isolated_ms, low_load_p50_ms=p50_ms,
        low_load_p99_ms=low_load.ranking.p99_ms,
        low_load_relayed_share=relayed.count / max(low_load.completed, 1),
        relay_overhead_ratio=ratio(relayed.p50_ms, isolated_ms) if relayed.count else None,
        relay_overhead_low=low,
        relay_overhead_high=high, isolated_passes=len(samples),
        matmul_peak_gflops=peak_gflops, achieved_gflops=achieved,
        achieved_fraction_of_peak=ratio(achieved, peak_gflops),
        ranking_parts=dict(relayed_parts or {}), path_counts=dict(low_load.path_counts),
        reload_copies=low_load.counters_end.get("reload_copies", 0.0),
        compute_by_path=dict(compute_by_path or {}))


# How each part of the relay's ranking latency reads in the overhead's account.
_OVERHEAD_PARTS = (("handoff", "hand-over to ranking (late send, stage timer, front end)"),
                   ("transport", "hop to the instance and back"),
                   ("lookup", "lookup (waiting for a pre-infer or reload still running)"),
                   ("queue", "queueing"), ("other", "routing and hand-offs"))


def describe_overhead(limit: LimitReport) -> str | None:
    """The low-load overhead over the isolated cached pass, part by part, in means (they add
    up to the mean latency, ``other`` being the rest); None when no part was reported."""
    parts = limit.ranking_parts.get("parts")
    if not isinstance(parts, dict):
        return None
    mean = {name: float(v["mean_ms"]) for name, v in parts.items()}
    total = sum(mean.values())
    isolated = limit.cached_rank_ms_isolated
    compute = f"compute {mean['compute']:.2f}" + (
        "" if isolated is None else f" (the pass alone {isolated:.2f}, "
                                    f"{mean['compute'] - isolated:+.2f})")
    rest = " + ".join(f"{label} {mean[name]:.2f}" for name, label in _OVERHEAD_PARTS)
    paths = ", ".join(f"{path} {n}" for path, n in sorted(limit.path_counts.items()))
    by_path = "; ".join(f"{path} {v['p50_ms']:.2f} / {v['mean_ms']:.2f} ({v['requests']:g})"
                        for path, v in limit.compute_by_path.items())
    return (f"overhead taken apart (means over {limit.ranking_parts.get('requests')} relayed "
            f"requests, ms): latency {total:.2f} = {compute} + {rest}; paths: {paths}; "
            f"reloads from host {limit.reload_copies:g}"
            + (f"; compute P50 / mean by path: {by_path}" if by_path else ""))
