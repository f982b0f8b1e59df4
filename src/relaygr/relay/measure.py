"""Fit the latency cost model by timing the running model on this device, at start-up.

A small grid of (prefix, suffix, candidates) shapes is timed with ``relaygr.timing.time_call``
(median of repeats, device-synchronised): one prefill per prefix length, then the full and the
cached ranking pass per shape. The default grid takes a few seconds on a 2-core CPU for the
``small`` model; pass a larger grid on an accelerator or for longer sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from relaygr.errors import ConfigError
from relaygr.model import HSTU
from relaygr.relay.costmodel import CostModelSource, LatencyCostModel, LatencySample
from relaygr.timing import time_call


@dataclass(frozen=True)
class FitGrid:
    """The shapes timed by ``fit_on_model``; shapes longer than ``max_seq_len`` are skipped."""

    # Four prefix lengths spanning 16x: enough to separate the linear from the quadratic term.
    prefix_tokens: tuple[int, ...] = (64, 256, 512, 1024)
    # Two suffix lengths so the cached model's suffix terms are measured, not borrowed.
    suffix_tokens: tuple[int, ...] = (0, 32)
    # Two candidate counts separate per-candidate cost from the fixed cost; the larger one is
    # what serving uses (hundreds), so predictions interpolate rather than extrapolate.
    candidates: tuple[int, ...] = (32, 256)
    # Time the histories with timestamps (production histories are timed; the time-bucket bias
    # is a real share of the cost of small models).
    timed: bool = True
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefix_tokens", "suffix_tokens", "candidates"):
            values = getattr(self, name)
            low = 0 if name == "suffix_tokens" else 1
            if not values or any(not isinstance(v, int) or v < low for v in values):
                raise ConfigError(f"FitGrid.{name} must be non-empty ints >= {low}, got {values}")
        if self.repeats < 1:
            raise ConfigError(f"FitGrid.repeats must be >= 1, got {self.repeats}")


def measure_samples(model: HSTU, device: torch.device | str,
                    grid: FitGrid | None = None) -> list[LatencySample]:
    """Time prefill, full and cached ranking over ``grid`` (untimed histories)."""
    grid = grid or FitGrid()
    device = torch.device(device)
    if model.device != device:
        raise ConfigError(f"model is on {model.device}, asked to time it on {device}")
    cfg = model.cfg
    gen = torch.Generator().manual_seed(grid.seed)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(1, cfg.num_items + 1, (n,), generator=gen).to(device)

    def times(n: int, start: int) -> torch.Tensor | None:
        # one event a minute, from `start` on: any realistic spacing costs the same
        return (start + 60 * torch.arange(n, dtype=torch.int64)).to(device) if grid.timed \
            else None

    samples = []
    for n in grid.prefix_tokens:
        shapes = [(s, c) for s in grid.suffix_tokens for c in grid.candidates
                  if n + s <= cfg.max_seq_len]
        if not shapes:
            continue
        prefix, prefix_ts = ids(n), times(n, 1_600_000_000)
        # a time_query="next" model's prefix is computed for the time the suffix goes on at
        after = 1_600_000_000 + 60 * n if grid.timed and cfg.next_time_query else None
        prefill = time_call(partial(model.prefill, prefix, prefix_ts, next_timestamp=after),
                            device, grid.repeats)
        kv = model.prefill(prefix, prefix_ts, next_timestamp=after)
        for s, c in shapes:
            suffix = ids(s) if s else None
            suffix_ts = times(s, 1_600_000_000 + 60 * n) if s else None
            cands = ids(c)
            full = time_call(partial(model.rank, cands, prefix_items=prefix,
                                     prefix_timestamps=prefix_ts, suffix_items=suffix,
                                     suffix_timestamps=suffix_ts), device, grid.repeats)
            cached = time_call(partial(model.rank, cands, prefix=kv, suffix_items=suffix,
                                       suffix_timestamps=suffix_ts), device, grid.repeats)
            samples.append(LatencySample(n, s, c, prefill.median_ms, full.median_ms,
                                         cached.median_ms))
    if len(samples) < 2:
        raise ConfigError(f"FitGrid yields {len(samples)} shapes within max_seq_len "
                          f"{cfg.max_seq_len}; need at least 2")
    return samples


def fit_on_model(model: HSTU, device: torch.device | str,
                 grid: FitGrid | None = None) -> LatencyCostModel:
    """A cost model fitted on timings of ``model`` (already on ``device``, in eval mode)."""
    samples = measure_samples(model, device, grid)
    source = CostModelSource("measured", str(torch.device(device)), str(model.dtype).replace(
        "torch.", ""), model.cfg)
    return LatencyCostModel.fit(samples, source)
