"""Engine-test helpers: FLOP-proportional cost models, prefix specs from a store, ranking passes
that raise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.engine.instance import RankingInstance
from relaygr.engine.types import PrefixSpec
from relaygr.kvcache import PrefixId
from relaygr.model import HSTUConfig
from relaygr.model.flops import prefill_flops, rank_flops
from relaygr.relay.costmodel import CostModelSource, LatencyCostModel, LatencySample


def flops_cost_model(cfg: HSTUConfig, gflops: float = 1.0) -> LatencyCostModel:
    """The cost model of an ideal device doing ``gflops`` GFLOP/s (no timing needed)."""
    def ms(flops: int) -> float:
        return flops / (gflops * 1e6)

    samples = [LatencySample(n, s, c, ms(prefill_flops(cfg, n)),
                             ms(rank_flops(cfg, c, n, s, cached=False)),
                             ms(rank_flops(cfg, c, n, s, cached=True)))
               for n in (16, 64, 256, 1024) for s in (0, 8) for c in (8, 64)]
    return LatencyCostModel.fit(samples, CostModelSource("measured", "cpu", "float32", cfg))


def spec_from_store(store: InMemoryHistoryStore, user: int) -> PrefixSpec:
    history = store.get(user)
    ts = None if history.timestamps is None else torch.tensor(history.timestamps)
    return PrefixSpec(PrefixId(user, history.num_events, history.version),
                      torch.tensor(history.items), ts, lambda n: store.version_at(user, n))


class FailingPasses:
    """An instance scheduler's ``run_batch`` whose ranking passes raise ``error`` (as a device
    error, a corrupted cache or a bug would) while it is set; None: they compute again."""

    def __init__(self, run_batch: Callable[[list[Any]], list[Any]],
                 error: Exception | None) -> None:
        self.run_batch = run_batch
        self.error = error

    def __call__(self, payloads: list[Any]) -> list[Any]:
        if self.error is not None:
            raise type(self.error)(*self.error.args)    # a fresh one each time
        return self.run_batch(payloads)


def failing_passes(instance: RankingInstance, error: Exception | None) -> FailingPasses:
    """Make ``instance``'s ranking passes raise ``error`` (``FailingPasses``) from now on."""
    passes = FailingPasses(instance.scheduler.run_batch, error)
    instance.scheduler.run_batch = passes
    return passes
