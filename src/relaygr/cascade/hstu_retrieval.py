"""Another HSTU training run's retrieval head as the cascade's retrieval stage: ``relaygr serve
--retrieval-run RUN`` with a ``relaygr train`` run, the stage ``relaygr eval --retrieval RUN``
measures.

The stage is ``train.stages.CheckpointRetrieval``, the function eval's cascade calls, for one
user at a time: the stage run's own layers prefill the newest ``max_seq_len`` events of the
user's history, its retrieval head scores the catalogue from the last state, every item of the
history is removed, and the top ``k`` are proposed best first with those scores (logits, the
scale ``StagesConfig.stage_weight`` fuses). So for a history, serve proposes what eval's cascade
proposes, scores equal up to float rounding (the prefill of one user against eval's batch), and
pre-processing's filter drops nothing.

The run must number items as the ranker does and read positions only
(``train.stage_runs.load_stage_run``: ``ConfigError`` otherwise). It holds no state between
calls (inference only), so the retrieval pool's threads may call it concurrently.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from relaygr.data.sequences import IdMap
from relaygr.model import HSTU
from relaygr.train.stage_runs import load_stage_run
from relaygr.train.stages import CheckpointRetrieval, RetrievalQuery


class HSTURunRetrieval:
    """An HSTU run's retrieval head behind ``RetrievalStage`` (see the module docstring)."""

    def __init__(self, model: HSTU, name: str = "hstu") -> None:
        self.stage = CheckpointRetrieval(model.eval())
        self.name = name

    @classmethod
    def load(cls, run_dir: Path, id_map: IdMap, device: torch.device | str = "cpu"
             ) -> HSTURunRetrieval:
        """The run in ``run_dir`` on ``device``, checked against the ranker's ``id_map``."""
        stage = load_stage_run(Path(run_dir), device, id_map, None)
        return cls(stage.model, f"{Path(run_dir).name} (HSTU retrieval head)")

    @property
    def num_items(self) -> int:
        return self.stage.model.cfg.num_items

    def propose(self, history: np.ndarray, k: int, user_id: int | None = None) -> np.ndarray:
        return self.scored(history, k, user_id)[0]

    def scored(self, history: np.ndarray, k: int, user_id: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """The head's top ``min(k, unseen items)`` outside ``history`` and their logits."""
        events = np.ascontiguousarray(history, dtype=np.int64)
        # the head reads the history alone: no user index, and its own prefill, not the ranker's
        query = RetrievalQuery(np.zeros(1, dtype=np.int64), [events], [])
        proposals = self.stage.propose(query, k)
        ids, scores = proposals.row(0)
        return ids.cpu().numpy(), scores.cpu().numpy().astype(np.float32)
