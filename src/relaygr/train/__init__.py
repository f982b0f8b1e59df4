"""Training and offline evaluation of HSTU on interaction logs.

Layers (lower never import upper): ``config`` / ``metrics`` / ``stages`` <- ``batches`` <-
``losses`` / ``mining`` <- ``evaluate`` / ``rank_phase`` <- ``checkpoint`` <- ``run_data``
<- ``trainer``.

Public names: ``Trainer`` / ``TrainResult`` (a run), ``TrainConfig`` with ``PRESETS`` /
``preset``, ``load_trained`` -> ``TrainedModel`` (a run directory's model + id map, for serving
and benchmarks), ``RankingMetrics``, ``target_ranks``, and the evaluation paths
``serving_ranks`` (prefill + rank: both heads and their cascade), ``retrieval_ranks_padded``,
``popularity_ranks``.
"""

from relaygr.train.checkpoint import (
    DatasetInfo,
    RunConfig,
    TrainedModel,
    TrainProgress,
    load_checkpoint,
    load_trained,
    read_run_config,
)
from relaygr.train.config import PRESETS, TrainConfig, preset
from relaygr.train.evaluate import popularity_ranks, retrieval_ranks_padded, serving_ranks
from relaygr.train.metrics import CUTOFFS, RankingMetrics, target_ranks
from relaygr.train.trainer import Trainer, TrainResult

__all__ = ["CUTOFFS", "PRESETS", "DatasetInfo", "RankingMetrics", "RunConfig", "TrainConfig",
           "TrainProgress", "TrainResult", "TrainedModel", "Trainer", "load_checkpoint",
           "load_trained",
           "popularity_ranks", "preset", "read_run_config", "retrieval_ranks_padded",
           "serving_ranks", "target_ranks"]
