"""The ranking phase: after the schedule, the ranking head alone learns to reorder retrieval's K.

A cascade's ranker sees only what the retrieval stage proposed, so it is trained on exactly that:
the best validation weights of the schedule are frozen (the retrieval head keeps its quality and
the candidate states stop moving under the head), and for ``rank_phase_epochs`` epochs every
user of every batch (up to ``rank_phase_users``) gives one ranking example at a random cut: the
positive against ``rank_negatives`` negatives, ``rank_hard_negatives`` of them from the
retrieval head's top ``rank_mine_k`` (``mining``). Only ``HSTU.rank_head`` has an optimizer.
After each epoch the cascade (retrieval's top ``rank_mine_k`` ranked by the head, through the
serving path) is validated; the head of the best validation NDCG@10, the head the phase started
from included, is kept. The phase is one unit: ``Trainer`` starts it from the schedule's best
weights as saved (``schedule/best.safetensors``), with its own generator and torch seed from the
run's seed, so interrupted and run again it gives the same result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from relaygr.model import HSTU
from relaygr.train.batches import BatchOrder, RankBatch, TrainingData
from relaygr.train.config import TrainConfig
from relaygr.train.losses import ranking_loss
from relaygr.train.metrics import RankingMetrics
from relaygr.train.mining import with_hard_negatives

Validate = Callable[[], RankingMetrics]


@dataclass(frozen=True)
class RankPhaseEpoch:
    """One epoch of the phase: its mean ranking loss and the cascade's validation metrics
    (epoch 0: the head the phase started from, no loss)."""

    epoch: int
    loss: float | None
    valid: RankingMetrics


class RankPhase:
    """Trains ``model.rank_head`` on frozen layers (see the module docstring)."""

    def __init__(self, config: TrainConfig, model: HSTU, data: TrainingData,
                 gen: torch.Generator, validate: Validate, miner: HSTU | None = None) -> None:
        """``miner``: the model whose retrieval head gives the hard negatives (default
        ``model``'s own; a separate stage's when the ranker is trained against one)."""
        self.cfg, self.model, self.data, self.gen = config, model, data, gen
        self.miner = model if miner is None else miner
        self.validate = validate
        self.optimizer = torch.optim.AdamW(model.rank_head.parameters(), lr=config.learning_rate,
                                           betas=(0.9, config.adam_beta2), weight_decay=0.0)

    def _batch(self, rows: torch.Tensor) -> RankBatch:
        cfg, device = self.cfg, self.model.device
        rank = self.data.rank_batch(rows, cfg.rank_phase_users, cfg.rank_negatives,
                                    self.gen).to(device)
        return with_hard_negatives(self.miner, rank, cfg.rank_hard_negatives, cfg.rank_mine_k,
                                   self.gen, reads_time=self.miner is self.model)

    def _epoch(self, order: BatchOrder) -> float:
        self.model.train()
        batches = self.data.epoch(order, self.cfg.batch_size, self.gen)
        total = 0.0
        for rows in batches:
            loss = ranking_loss(self.model, self._batch(rows), self.cfg.rank_temperature,
                                head_only=True)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total += float(loss.detach())
        return total / len(batches)

    def run(self, order: BatchOrder, log: Callable[[str], None]) -> list[RankPhaseEpoch]:
        """Run the phase; on return ``model.rank_head`` holds the best validated head. Returns
        every validated epoch, epoch 0 (the starting head) first."""
        head = self.model.rank_head
        start = self.validate()
        best_ndcg, best_state = start.ndcg[10], _copy(head.state_dict())
        log(f"ranking phase, start | valid cascade {start.summary()}")
        epochs = [RankPhaseEpoch(0, None, start)]
        for epoch in range(1, self.cfg.rank_phase_epochs + 1):
            loss = self._epoch(order)
            valid = self.validate()
            epochs.append(RankPhaseEpoch(epoch, loss, valid))
            log(f"ranking phase, epoch {epoch} loss {loss:.4f} | valid cascade "
                f"{valid.summary()}")
            if valid.ndcg[10] > best_ndcg:
                best_ndcg, best_state = valid.ndcg[10], _copy(head.state_dict())
        head.load_state_dict(best_state)
        self.model.eval()
        return epochs


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}
