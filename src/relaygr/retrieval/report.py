"""Evaluate a run (every seed) and its baselines under one protocol, on the run's own splits.

The answer is the JSON ``relaygr eval-retrieval`` writes::

    {"protocol": "cvgae", "pair": ..., "seeds": [...],
     "model": {"sport": {"hr@10": mean, "hr@10_std": std, ...}, "cloth": {...}},
     "baselines": {"popularity": {...}, "itemcf": {...}, "<name>": {...}},
     "fused": {"model+itemcf": {...}}, "fusion_weights": {"0": w, ...},
     "per_seed": {"model": {"0": {...}}, ...}}

``popularity`` and ``itemcf`` need no training (``relaygr.retrieval.evaluate``). ``model+itemcf``
is the run's model and item-CF as two retrieval channels, scores summed with the weight each
seed's validation rows choose from ``FUSION_WEIGHTS`` (best mean NDCG@10 over the domains, as
training selects epochs; never test).

Baseline runs must hold the same splits (same pair, split kind and seeds; test rows and
negatives identical), so every number in one report ranks the same held-out items against the
same negatives. Std is the population std over seeds (0 for one seed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relaygr.errors import CheckpointError, ConfigError
from relaygr.retrieval.checkpoint import RunInfo, load_seed, read_run_info
from relaygr.retrieval.evaluate import (
    ItemCFScorer,
    PopularityScorer,
    Scorer,
    SumScorer,
    VectorScorer,
    full_ranks,
    hits,
    hr_ndcg,
    sampled_ranks,
)
from relaygr.retrieval.model import RetrievalModel
from relaygr.retrieval.splits import DomainSplit, Protocol

Metrics = dict[str, dict[str, float]]   # domain -> metric -> value

BUILT_IN = ("model", "popularity", "itemcf", "model+itemcf")   # rows every report has

# item-CF's weight beside the model: its sum grows with the user's history (MovieLens users hold
# ~165 items, Amazon ones ~6), so the grid spans three decades
FUSION_WEIGHTS = (0.0, 0.01, 0.03, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def evaluate_splits(scorer: Scorer, splits: dict[str, DomainSplit], protocol: Protocol) -> Metrics:
    """One scorer's test metrics on each domain's split under ``protocol``."""
    out: Metrics = {}
    for d, s in splits.items():
        if protocol is Protocol.FULL:
            known = np.concatenate([s.train, s.valid])
            out[d] = hits(full_ranks(scorer, d, s.test, s.num_items, known))
        else:
            out[d] = hr_ndcg(sampled_ranks(scorer, d, s.test, s.test_negatives))
    return out


def mean_std(per_seed: list[Metrics]) -> Metrics:
    out: Metrics = {}
    for d in per_seed[0]:
        out[d] = {}
        for k in per_seed[0][d]:
            values = np.array([m[d][k] for m in per_seed])
            out[d][k] = float(values.mean())
            out[d][f"{k}_std"] = float(values.std())
    return out


def _same_splits(a: dict[str, DomainSplit], b: dict[str, DomainSplit], where: Path) -> None:
    """Every part of every domain's split equal: the test rows and negatives, and the training
    and validation rows a baseline learnt and chose its epoch on (another ``valid_share``
    leaves the test rows as they were and the training rows not)."""
    parts = ("train", "valid", "test", "valid_negatives", "test_negatives")
    for d in a:
        if d not in b or not all(np.array_equal(getattr(a[d], p), getattr(b[d], p))
                                 for p in parts):
            raise CheckpointError(f"{where} was trained on other splits than the model's run")


@dataclass(frozen=True)
class RunScores:
    """Per-seed test metrics of one run."""

    per_seed: dict[int, Metrics]

    @property
    def summary(self) -> Metrics:
        return mean_std(list(self.per_seed.values()))


def _check_protocol(run_dir: Path, info: RunInfo, protocol: Protocol) -> None:
    if not protocol.accepts(info.split):
        raise CheckpointError(f"{run_dir} holds {info.split.value} splits; protocol "
                              f"{protocol.value} needs {protocol.split_kind.value}")


def score_run(run_dir: Path, protocol: Protocol,
              reference: dict[int, dict[str, DomainSplit]] | None = None) -> RunScores:
    """Test metrics of every seed of ``run_dir`` (checked against ``reference`` splits)."""
    info = read_run_info(run_dir)
    _check_protocol(run_dir, info, protocol)
    missing = sorted(set(reference or ()) - set(info.seeds))
    if missing:      # its mean would be over other seeds than the model's, splits included
        raise CheckpointError(f"{run_dir} lacks seed(s) {missing} of the model's run: a "
                              "baseline is compared seed for seed (train them into it with "
                              "--add-seeds)")
    per_seed: dict[int, Metrics] = {}
    for seed in info.seeds:
        trained = load_seed(run_dir, info, seed)
        if reference is not None:
            if seed not in reference:
                raise CheckpointError(f"{run_dir} has seed {seed}, the model's run does not")
            _same_splits(reference[seed], trained.splits, run_dir)
        per_seed[seed] = evaluate_splits(model_scorer(trained.model, info.domains),
                                         trained.splits, protocol)
    return RunScores(per_seed)


def model_scorer(model: RetrievalModel, domains: tuple[str, ...]) -> VectorScorer:
    """A trained ``RetrievalModel``'s served vectors as a scorer."""
    return VectorScorer({d: model.user_vectors(d) for d in domains},
                        {d: model.item_vectors(d) for d in domains})


def item_cf(splits: dict[str, DomainSplit], num_users: int) -> ItemCFScorer:
    """Item-CF over the splits' training rows (never their validation or test rows)."""
    return ItemCFScorer.of({d: s.train for d, s in splits.items()},
                           {d: s.num_items for d, s in splits.items()}, num_users)


def choose_fusion_weight(model: Scorer, other: Scorer, splits: dict[str, DomainSplit]) -> float:
    """The weight of ``FUSION_WEIGHTS`` whose fused scores have the best mean validation
    NDCG@10 over the domains (the first of equals)."""
    def score(w: float) -> float:
        fused = SumScorer(model, other, w)
        return float(np.mean([hr_ndcg(sampled_ranks(fused, d, s.valid, s.valid_negatives))
                              ["ndcg@10"] for d, s in splits.items()]))
    scores = [score(w) for w in FUSION_WEIGHTS]
    return FUSION_WEIGHTS[int(np.argmax(scores))]


def report(run_dir: Path, protocol: Protocol, baselines: dict[str, Path]) -> dict[str, Any]:
    """The JSON report of the module doc."""
    taken = set(baselines) & set(BUILT_IN)
    if taken:
        raise ConfigError(f"baseline names {sorted(taken)} are the report's own rows; "
                          "name the runs otherwise")
    info = read_run_info(run_dir)
    _check_protocol(run_dir, info, protocol)
    splits: dict[int, dict[str, DomainSplit]] = {}
    runs: dict[str, RunScores] = {}
    model_m: dict[int, Metrics] = {}
    pop: dict[int, Metrics] = {}
    cf: dict[int, Metrics] = {}
    fused: dict[int, Metrics] = {}
    weights: dict[str, float] = {}
    for seed in info.seeds:            # each seed's model and its splits, loaded once
        trained = load_seed(run_dir, info, seed)
        sp = splits[seed] = trained.splits
        model = model_scorer(trained.model, info.domains)
        model_m[seed] = evaluate_splits(model, sp, protocol)
        pop[seed] = evaluate_splits(PopularityScorer.of({d: s.train for d, s in sp.items()},
                                                        {d: s.num_items for d, s in sp.items()}),
                                    sp, protocol)
        item_cf_scorer = item_cf(sp, info.num_users)
        cf[seed] = evaluate_splits(item_cf_scorer, sp, protocol)
        weight = choose_fusion_weight(model, item_cf_scorer, sp)
        weights[str(seed)] = weight
        fused[seed] = evaluate_splits(SumScorer(model, item_cf_scorer, weight), sp, protocol)
    runs["model"] = RunScores(model_m)
    runs["popularity"] = RunScores(pop)
    runs["itemcf"] = RunScores(cf)
    for name, path in baselines.items():
        runs[name] = score_run(path, protocol, reference=splits)
    runs["model+itemcf"] = RunScores(fused)
    return {"protocol": protocol.value, "pair": info.pair, "seeds": list(info.seeds),
            "model_preset": info.preset,
            "model": runs["model"].summary,
            "baselines": {k: r.summary for k, r in runs.items()
                          if k not in ("model", "model+itemcf")},
            "fused": {"model+itemcf": runs["model+itemcf"].summary},
            "fusion_weights": weights,
            "per_seed": {k: {str(s): m for s, m in r.per_seed.items()} for k, r in runs.items()}}
