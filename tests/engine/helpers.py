"""Engine-test helpers: FLOP-proportional cost models, prefix specs from a store."""

from __future__ import annotations

import torch

from relaygr.cascade.store import InMemoryHistoryStore
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
