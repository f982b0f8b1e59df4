"""The stages ``relaygr serve`` serves, behind the offline cascade's ``RetrievalStage`` interface
(``relaygr eval --retrieval``):

- ``TrainedRunStage``: a trained retrieval run (``relaygr train-retrieval``), the stage ``relaygr
  serve --retrieval-run`` serves (``TrainedRetrieval``: the user tower on the latest events, FAISS
  over the item tower), interleaved with the default stage below and the item-to-item channel of
  the run's training interactions (``StagesConfig.retrieval_shares``, ``--retrieval-run-share``,
  ``--retrieval-item-cf-rest-share``; serve's construction,
  ``trained_retrieval.beside_the_default``).
- ``EmbeddingStage``: serve's default without a run (``EmbeddingRetrieval``: FAISS over the
  ranker's own item embeddings, the user the normalised, recency-weighted mean of its latest
  events' embeddings), ``--retrieval item-embeddings``.

Both read the user's latest ``StagesConfig.retrieval_history`` events, the k-th newest weighing
``retrieval_recency ** k``, as serve does (``--retrieval-history``, ``--retrieval-recency``).

The offline cascade removes the user's whole history from the proposals (as the model's own
retrieval head does there), and hands the stage the dataset's user id (``UserSequences.user_ids``)
so a user the run trained on starts from its trained embedding, as when serving: a retrieval run
is refused data whose user ids serving could not name (``data.servable.check_user_ids``).

``HstuRunStage``: an HSTU run's retrieval head (``CheckpointRetrieval``), whole history, alone,
with the run it was loaded from, so that the evaluation can tell which of its targets that run
trained on (``run_data.check_held_out``: the run's recorded data read again).

``stage_from_args``: the stage ``relaygr eval --retrieval`` names (one of these, a registered
stage, or an HSTU run's retrieval head), its options checked.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from relaygr.cascade.config import StagesConfig
from relaygr.cascade.proposals import EmbeddingRetrieval, InterleavedRetrieval
from relaygr.cascade.trained_retrieval import (
    RankerCatalogue,
    TrainedRetrieval,
    beside_the_default,
)
from relaygr.data import TableSpec, check_user_ids
from relaygr.data.sequences import UserSequences
from relaygr.data.split import EvalCases
from relaygr.errors import CatalogueMismatchError, ConfigError
from relaygr.model import HSTU
from relaygr.train import TrainedModel
from relaygr.train.run_data import HeldOutCheck, check_held_out
from relaygr.train.stage_runs import StageRunKind, load_stage_run, stage_run_kind
from relaygr.train.stages import (
    RETRIEVAL_STAGES,
    CheckpointRetrieval,
    Proposals,
    RetrievalQuery,
    RetrievalStage,
    retrieval_stage,
)

# The user's window at request time (its latest events) and their weights, as serving's
# defaults read them.
RECENT_EVENTS = StagesConfig.retrieval_history
RECENCY = StagesConfig.retrieval_recency
RUN_SHARE = StagesConfig.retrieval_run_share
ITEM_CF_REST_SHARE = StagesConfig.retrieval_item_cf_rest_share


class TrainedRunStage:
    """``propose(query, k) -> Proposals`` of a ``TrainedRetrieval`` (``run``), beside the
    default stage as serve serves it (``stage``; module docstring)."""

    def __init__(self, run: TrainedRetrieval, stage: TrainedRetrieval | InterleavedRetrieval,
                 user_ids: np.ndarray, stages: StagesConfig) -> None:
        """``stages``: the window and shares ``stage`` was built with (``beside_the_default``)."""
        self.run, self.stage, self.user_ids, self.stages = run, stage, user_ids, stages

    @classmethod
    def load(cls, run_dir: Path, seqs: UserSequences, dataset: str, model: HSTU,
             recent_events: int = RECENT_EVENTS, recency: float = RECENCY,
             share: float = RUN_SHARE, stage_weight: float = 0.0,
             item_cf_rest_share: float = ITEM_CF_REST_SHARE) -> TrainedRunStage:
        """``model``: the ranker, whose item embeddings are the default stage; ``stage_weight``:
        the cascade's, refused beside them (``trained_retrieval.check_run_share``);
        ``item_cf_rest_share``: the run's item-to-item channel's share of what the run leaves
        (``cascade.item_cf``). ``ConfigError`` unless ``seqs``' user ids are integers serving
        names users by (``check_user_ids``): the run looks each up by that id, as serve does."""
        check_user_ids(seqs.source, seqs.user_ids)
        items = np.asarray(seqs.id_map.items)
        if items.dtype.kind not in "iu":
            raise CatalogueMismatchError("the ranker names its items by strings; a retrieval "
                                         "run's catalogue records integer ids")
        ranker = RankerCatalogue(dataset, items, dataset_users=True)
        run = TrainedRetrieval.load(run_dir, ranker, recent_events, recency=recency)
        stages = StagesConfig(retrieval_history=recent_events, retrieval_recency=recency,
                              retrieval_run_share=share, stage_weight=stage_weight,
                              retrieval_item_cf_rest_share=item_cf_rest_share)
        return cls(run, beside_the_default(run, stages, model), seqs.user_ids, stages)

    @property
    def name(self) -> str:
        return self.stage.name

    def targets_trained_on(self, cases: EvalCases) -> float:
        """Share of ``cases``' targets that are the run's own training interactions (its split
        held out other events than this evaluation's): where above 0, the stage's figures are
        not a clean test."""
        if not len(cases):
            return 0.0
        held = self.run.trained_on(self.user_ids[cases.users], cases.targets)
        return float(held.mean())

    def window(self) -> dict[str, float]:
        """The user's window (latest events, recency) and the channels' shares, as reported."""
        _, run_share, item_cf_share = self.stages.retrieval_shares
        return {"history": self.run.recent_events, "recency": self.run.recency,
                "run_share": run_share, "item_cf_share": item_cf_share}

    def propose(self, query: RetrievalQuery, k: int) -> Proposals:
        return _proposals(query, k, lambda user, history: self.stage.scored(
            history, k, int(self.user_ids[user]), exclude=history))


class HstuRunStage:
    """``propose(query, k) -> Proposals`` of an HSTU run's retrieval head (``CheckpointRetrieval``
    of ``run``, which ``load_stage_run`` checked against the ranker)."""

    def __init__(self, run: TrainedModel) -> None:
        self.run, self.stage = run, CheckpointRetrieval(run.model)

    def held_out(self, seqs: UserSequences, cases: EvalCases,
                 spec: TableSpec | None = None) -> HeldOutCheck:
        """``cases``' targets against the run's training, read from the data it records: the
        share it trained on, or why that could not be measured (``check_held_out``)."""
        return check_held_out(self.run, seqs, cases, spec)

    def propose(self, query: RetrievalQuery, k: int) -> Proposals:
        return self.stage.propose(query, k)


class EmbeddingStage:
    """``propose(query, k) -> Proposals`` of serve's default stage, ``EmbeddingRetrieval``
    (module docstring), by default over the same ``RECENT_EVENTS`` latest events and weights
    (``RECENCY``) serve reads."""

    name = EmbeddingRetrieval.name

    def __init__(self, stage: EmbeddingRetrieval) -> None:
        self.stage = stage

    @classmethod
    def of(cls, model: HSTU, recent_events: int = RECENT_EVENTS,
           recency: float = RECENCY) -> EmbeddingStage:
        return cls(EmbeddingRetrieval.of(model, recent_events, recency=recency))

    def window(self) -> dict[str, float]:
        """The user's window (latest events, recency), as reported."""
        return {"history": self.stage.recent_events, "recency": self.stage.recency}

    def propose(self, query: RetrievalQuery, k: int) -> Proposals:
        return _proposals(query, k, lambda _, history: self.stage.scored(history, k,
                                                                         exclude=history))


def _proposals(query: RetrievalQuery, k: int,
               scored: Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]) -> Proposals:
    """``Proposals`` of a serving stage's ``scored(user, history)`` for each user of ``query``
    (its whole history excluded by the stage), rows padded past their end."""
    ids = torch.zeros((len(query.histories), k), dtype=torch.long)
    scores = torch.full((len(query.histories), k), -math.inf)
    for j, (user, history) in enumerate(zip(query.users, query.histories, strict=True)):
        found, score = scored(user, np.asarray(history, dtype=np.int64))
        ids[j, :len(found)] = torch.from_numpy(found)
        scores[j, :len(found)] = torch.from_numpy(score.astype(np.float32))
    return Proposals(ids, scores)


def stage_from_args(args: argparse.Namespace, ranker: TrainedModel, seqs: UserSequences
                    ) -> RetrievalStage:
    """``--retrieval``: a registered stage name, serve's default stage (``EmbeddingStage``), or a
    run directory: an HSTU run's retrieval head (``HstuRunStage``) or a trained retrieval run
    (``TrainedRunStage``)."""
    history = RECENT_EVENTS if args.retrieval_history is None else args.retrieval_history
    recency = RECENCY if args.retrieval_recency is None else args.retrieval_recency
    share = RUN_SHARE if args.retrieval_run_share is None else args.retrieval_run_share
    cf_rest = ITEM_CF_REST_SHARE if args.retrieval_item_cf_rest_share is None \
        else args.retrieval_item_cf_rest_share
    if args.retrieval in RETRIEVAL_STAGES:
        _no_window(args)
        return retrieval_stage(args.retrieval, ranker.model)
    if history < 1 or not 0 < recency <= 1:
        raise ConfigError("--retrieval-history must be >= 1 and --retrieval-recency in (0, 1], "
                          f"got {history} and {recency}")
    if not 0 < share <= 1:
        raise ConfigError(f"--retrieval-run-share must be in (0, 1], got {share}")
    if not 0 <= cf_rest <= 1:
        raise ConfigError(f"--retrieval-item-cf-rest-share must be in [0, 1], got {cf_rest}")
    if share == 1 and args.retrieval_item_cf_rest_share:
        raise ConfigError("--retrieval-run-share 1 serves the run alone: it leaves no share to "
                          "--retrieval-item-cf-rest-share")
    if args.retrieval == EmbeddingStage.name:
        if args.retrieval_run_share is not None \
                or args.retrieval_item_cf_rest_share is not None:
            raise ConfigError("--retrieval-run-share and --retrieval-item-cf-rest-share are a "
                              f"retrieval run's channels' shares beside {EmbeddingStage.name}; "
                              f"--retrieval {args.retrieval} is not a run")
        if args.fit_stage_weight:
            raise ConfigError(f"--fit-stage-weight needs an HSTU run as the stage "
                              f"({EmbeddingStage.name} scores are inner products on another "
                              "scale)")
        return EmbeddingStage.of(ranker.model, history, recency)
    path = Path(args.retrieval)
    if not path.is_dir():
        names = ", ".join(sorted([*RETRIEVAL_STAGES, EmbeddingStage.name]))
        raise ConfigError(f"--retrieval {args.retrieval!r} is neither a stage ({names}) nor a "
                          "run directory")
    if stage_run_kind(path) is StageRunKind.RETRIEVAL:
        if args.fit_stage_weight:
            raise ConfigError("--fit-stage-weight needs an HSTU run as the stage (a retrieval "
                              "run's scores are inner products on another scale)")
        return TrainedRunStage.load(path, seqs, ranker.run.dataset.name, ranker.model,
                                    history, recency, share, args.stage_weight, cf_rest)
    _no_window(args)
    # --fit-stage-weight chooses on the ranker's validation users: the stage must hold them out
    held_out = ranker.run.train if args.fit_stage_weight else None
    return HstuRunStage(load_stage_run(path, args.device, ranker.id_map, held_out))


def _no_window(args: argparse.Namespace) -> None:
    """An HSTU head as the stage reads the whole history: a window asked of it is refused (and
    a share: it serves alone)."""
    if args.retrieval_history is not None or args.retrieval_recency is not None \
            or args.retrieval_run_share is not None \
            or args.retrieval_item_cf_rest_share is not None:
        raise ConfigError("--retrieval-history and --retrieval-recency set the user window of "
                          f"{EmbeddingStage.name} and of a retrieval run, --retrieval-run-share "
                          "and --retrieval-item-cf-rest-share a retrieval run's channels' shares; "
                          "an HSTU head reads the whole history, alone")
