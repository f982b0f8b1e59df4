"""A trained retrieval run (``relaygr train-retrieval``) as the retrieval stage of ``relaygr
eval``'s cascade: the stage ``relaygr serve --retrieval-run`` serves (``TrainedRetrieval``: the
user tower on the latest events, FAISS over the item tower), behind the offline cascade's
``RetrievalStage`` interface.

The offline cascade removes the user's whole history from the proposals (as the model's own
retrieval head does there), and hands the stage the dataset's user id (``UserSequences.user_ids``)
so a user the run trained on starts from its trained embedding, as when serving.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from relaygr.cascade.config import StagesConfig
from relaygr.cascade.trained_retrieval import RankerCatalogue, TrainedRetrieval
from relaygr.data.sequences import UserSequences
from relaygr.errors import CatalogueMismatchError
from relaygr.train.stages import Proposals, RetrievalQuery

# The user tower's window at request time, as serving's default reads it.
RECENT_EVENTS = StagesConfig.retrieval_history


class TrainedRunStage:
    """``propose(query, k) -> Proposals`` of a ``TrainedRetrieval`` (module docstring)."""

    def __init__(self, stage: TrainedRetrieval, user_ids: np.ndarray) -> None:
        self.stage, self.user_ids = stage, user_ids

    @classmethod
    def load(cls, run_dir: Path, seqs: UserSequences, dataset: str) -> TrainedRunStage:
        items = np.asarray(seqs.id_map.items)
        if items.dtype.kind not in "iu":
            raise CatalogueMismatchError("the ranker names its items by strings; a retrieval "
                                         "run's catalogue records integer ids")
        ranker = RankerCatalogue(dataset, items, dataset_users=True)
        return cls(TrainedRetrieval.load(run_dir, ranker, RECENT_EVENTS), seqs.user_ids)

    def propose(self, query: RetrievalQuery, k: int) -> Proposals:
        ids = torch.zeros((len(query.histories), k), dtype=torch.long)
        scores = torch.full((len(query.histories), k), -math.inf)
        for j, (user, history) in enumerate(zip(query.users, query.histories, strict=True)):
            found, score = self.stage.scored(np.asarray(history), k,
                                             int(self.user_ids[user]), exclude=history)
            ids[j, :len(found)] = torch.from_numpy(found)
            scores[j, :len(found)] = torch.from_numpy(score.astype(np.float32))
        return Proposals(ids, scores)
