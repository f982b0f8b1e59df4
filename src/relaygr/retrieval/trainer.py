"""Training loop of the dual-tower model: matching + intra-CL per domain, inter-CL across them.

One step takes ``batch_size`` training edges of each domain. Per domain ``d`` (partner ``p``)::

    L_d = L_match(d) + lambda_intra * L_intra(d) + lambda_inter * L_inter(d -> p)
    L_inter(d -> p) = (1 - w) * L_aligned + w * L_neighbour

Intra-CL views are two edge-dropout graphs drawn per epoch, distinct for each domain. Inter-CL
anchors are the batch's users; their partner-domain vectors are the positives, curriculum (or
uniform) users' partner-domain vectors the negatives. Under ``StopGradient.PARTNER`` everything
taken from the partner domain is detached, so inter-CL moves only the anchor's tower and never
pulls the partner's representation (learnt by its own matching and intra-CL) toward it.

Validation after every epoch on the split's validation rows (never test); the best mean NDCG@10
over the domains is kept; ``patience`` validations without improvement stop the run. Seeded:
the same seed, data and config give the same weights.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from relaygr.errors import TrainingDivergedError
from relaygr.retrieval import losses
from relaygr.retrieval.config import (
    Encoder,
    LRSchedule,
    MatchingLoss,
    Pacing,
    SCCDRConfig,
    StopGradient,
)
from relaygr.retrieval.curriculum import NegativeSampler, difficulty_pools
from relaygr.retrieval.encoders import SAGETower, TowerOutput
from relaygr.retrieval.evaluate import VectorScorer, hr_ndcg, sampled_ranks
from relaygr.retrieval.graph import BipartiteGraph
from relaygr.retrieval.model import RetrievalModel
from relaygr.retrieval.splits import DomainSplit


@dataclass
class TrainResult:
    """The best-validation model and the run's per-epoch records."""

    model: RetrievalModel
    best_epoch: int
    best_score: float
    elapsed_s: float
    stopped: str
    history: list[dict[str, Any]] = field(default_factory=list)


def joint_interactions(graphs: dict[str, BipartiteGraph]) -> Any:
    """``[R_1 | R_2]``: the users' items in both domains side by side (Katz's graph)."""
    import scipy.sparse as sp
    return sp.hstack([g.interactions() for g in graphs.values()], format="csr")


def held_out_rows(splits: dict[str, DomainSplit]) -> dict[str, np.ndarray]:
    """Each domain's validation and test rows: what no graph of the model may hold."""
    return {d: np.concatenate([s.valid, s.test]) for d, s in splits.items()}


def validate(model: RetrievalModel, splits: dict[str, DomainSplit]) -> dict[str, dict[str, float]]:
    """HR/NDCG@10 of each domain's validation rows against their negatives."""
    model.refresh()
    scorer = VectorScorer({d: model.user_vectors(d) for d in splits},
                          {d: model.item_vectors(d) for d in splits})
    return {d: hr_ndcg(sampled_ranks(scorer, d, s.valid, s.valid_negatives))
            for d, s in splits.items()}


class RetrievalTrainer:
    """Trains a ``RetrievalModel`` on each domain's ``split.train`` (see the module doc)."""

    def __init__(self, cfg: SCCDRConfig, splits: dict[str, DomainSplit], num_users: int,
                 seed: int, progress_bar: bool = True) -> None:
        assert len(splits) in (1, 2), "one domain, or a pair"
        self.cfg, self.splits, self.seed = cfg, splits, seed
        self.progress_bar = progress_bar
        torch.manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.graphs = {d: BipartiteGraph(num_users, s.num_items, s.train)
                       for d, s in splits.items()}
        # the domains whose positives meet causal user vectors (config: causal_window)
        self.sequences = {d: _sequence(s) for d, s in splits.items()
                          if cfg.causal_window > 0 and s.train_pos is not None
                          and cfg.encoder is Encoder.SAGE and len(splits) == 1}
        self.model = RetrievalModel(self.graphs, cfg, held_out_rows(splits))
        self.sampler = self._sampler(num_users)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.learning_rate,
                                          weight_decay=cfg.weight_decay)
        self.scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer,
                                                                     cfg.max_epochs)
                          if cfg.lr_schedule is LRSchedule.COSINE else None)

    def _sampler(self, num_users: int) -> NegativeSampler | None:
        if not self.cfg.uses_inter or len(self.splits) < 2:
            return None
        pools = None
        if self.cfg.pacing is not Pacing.NONE:
            pools = difficulty_pools(joint_interactions(self.graphs), self.cfg.katz_beta,
                                     self.cfg.katz_hops, self.cfg.pool_size, self.rng)
        return NegativeSampler(num_users, self.cfg.pacing, pools, self.cfg.start_share,
                               self.cfg.curriculum_epochs)

    def _views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if not self.cfg.uses_intra:
            return {}
        views = {}
        for d in self.graphs:
            tower = self.model.tower(d)
            g = tower.propagation
            views[d] = (tower.adjacency_of(g.drop_edges(self.cfg.edge_dropout, self.rng)),
                        tower.adjacency_of(g.drop_edges(self.cfg.edge_dropout, self.rng)))
        return views

    def _causal_users(self, domain: str, out: TowerOutput, batch: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's rows (user, item, row) that have an earlier item, and each one's user
        vector from its ``causal_window`` items before it (config)."""
        items, start, where = self.sequences[domain]
        encoder = self.model.tower(domain).encoder
        assert isinstance(encoder, SAGETower), "causal vectors need the GraphSAGE tower"
        pos = where[batch[:, 2]]
        batch, pos = batch[pos > start[pos]], pos[pos > start[pos]]
        back = torch.arange(1, self.cfg.causal_window + 1)
        idx = pos[:, None] - back                                      # (B, L) newest first
        valid = idx >= start[pos][:, None]
        w = (self.cfg.causal_recency ** (back - 1).double())[None, :] * valid
        share = (w / w.sum(1, keepdim=True)).float()
        return batch, encoder.users_from_item_lists(batch[:, 0], items[idx.clamp(min=0)], share,
                                                    out.item_states)

    def _matching(self, domain: str, out: TowerOutput, batch: torch.Tensor) -> torch.Tensor:
        if domain in self.sequences:
            batch, users = self._causal_users(domain, out, batch)
            if not len(batch):                  # every row a user's first item: no term
                return out.items.sum() * 0.0    # (kept in the graph, so backward still runs)
        else:
            users = out.users[batch[:, 0]]
        items = out.items[batch[:, 1]]
        n_items = len(out.items)
        bias = self.model.tower(domain).item_bias()
        bpr = self.cfg.matching_loss is MatchingLoss.BPR
        neg = torch.randint(0, n_items, (len(batch) if bpr else self.cfg.num_negatives,),
                            generator=self.gen)
        loss = losses.bpr_matching if bpr else losses.softmax_matching
        if bias is None:
            match = loss(users, items, out.items[neg], self.cfg.temperature)
        else:
            match = loss(users, items, out.items[neg], self.cfg.temperature,
                         bias[batch[:, 1]], bias[neg])
        if self.cfg.embedding_l2 > 0:
            match = match + self.cfg.embedding_l2 * self._embedding_norm(domain, batch, neg)
        return match

    def _embedding_norm(self, domain: str, batch: torch.Tensor,
                        negatives: torch.Tensor) -> torch.Tensor:
        """Mean squared L2 norm of the layer-0 rows a matching step uses (users, positives,
        negatives), each row counted once per use."""
        encoder = self.model.tower(domain).encoder
        users, items = encoder.user_emb, encoder.item_emb
        assert isinstance(users, nn.Embedding) and isinstance(items, nn.Embedding)
        rows = (users.weight[batch[:, 0]], items.weight[batch[:, 1]], items.weight[negatives])
        return sum((r.pow(2).sum(-1).sum() for r in rows), torch.zeros(())) / len(batch)

    def _intra(self, domain: str, views: tuple[torch.Tensor, torch.Tensor],
               batch: torch.Tensor) -> torch.Tensor:
        tower = self.model.tower(domain)
        v1, v2 = tower(views[0]), tower(views[1])
        total = torch.zeros(())
        for ids, a, b in ((batch[:, 0].unique(), v1.users, v2.users),
                          (batch[:, 1].unique(), v1.items, v2.items)):
            shuffled = torch.randperm(len(ids), generator=self.gen)
            total = total + losses.intra_bce(a[ids], b[ids], shuffled,
                                             self.cfg.intra_temperature)
        return total / 2

    def _inter(self, anchor_out: TowerOutput, partner: str, partner_out: TowerOutput,
               anchors: torch.Tensor, epoch: int) -> torch.Tensor:
        assert self.sampler is not None
        cfg = self.cfg
        p_users = partner_out.users
        p_nbr = torch.sparse.mm(self.model.tower(partner).neighbour_mean, partner_out.items)
        if cfg.stop_gradient is StopGradient.PARTNER:
            p_users, p_nbr = p_users.detach(), p_nbr.detach()
        negs = self.sampler.sample(anchors, cfg.inter_negatives, epoch, self.gen)
        a = anchor_out.users[anchors]
        aligned = losses.aligned_user(a, p_users[anchors], p_users[negs], cfg.inter_temperature)
        nbr = losses.neighbour_similarity(a, p_nbr[anchors])
        return (1 - cfg.neighbour_weight) * aligned + cfg.neighbour_weight * nbr

    def _step(self, batches: dict[str, torch.Tensor], views: dict[str, Any],
              epoch: int) -> dict[str, float]:
        cfg, parts = self.cfg, {"match": 0.0, "intra": 0.0, "inter": 0.0}
        outs = {d: self.model.tower(d)() for d in self.splits}
        loss = torch.zeros(())
        for d, batch in batches.items():
            match = self._matching(d, outs[d], batch)
            loss = loss + match
            parts["match"] += float(match.detach())
            if cfg.uses_intra:
                intra = self._intra(d, views[d], batch)
                loss = loss + cfg.lambda_intra * intra
                parts["intra"] += float(intra.detach())
            if self.sampler is not None:
                partner = next(p for p in self.splits if p != d)
                inter = self._inter(outs[d], partner, outs[partner], batch[:, 0].unique(), epoch)
                loss = loss + cfg.lambda_inter * inter
                parts["inter"] += float(inter.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        parts["total"] = float(loss.detach())
        return parts

    def _epoch(self, epoch: int) -> dict[str, float]:
        # (user, item, row): the row finds a causal positive's place in its user's sequence
        edges = {d: torch.cat([torch.from_numpy(s.train), torch.arange(len(s.train))[:, None]],
                              dim=1) for d, s in self.splits.items()}
        steps = math.ceil(max(len(e) for e in edges.values()) / self.cfg.batch_size)
        perms = {d: torch.randperm(len(e), generator=self.gen) for d, e in edges.items()}
        views = self._views()
        sums: dict[str, float] = {}
        bar = tqdm(range(steps), desc=f"epoch {epoch + 1}", unit="step", leave=False,
                   disable=not self.progress_bar, dynamic_ncols=True)
        for step in bar:
            batches = {}
            for d, e in edges.items():
                idx = torch.arange(step * self.cfg.batch_size, (step + 1) * self.cfg.batch_size)
                batches[d] = e[perms[d][idx % len(e)]]
            parts = self._step(batches, views, epoch)
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v / steps
            bar.set_postfix(loss=f"{parts['total']:.3f}")
        return sums

    def fit(self) -> TrainResult:
        cfg, started = self.cfg, time.perf_counter()
        best_score, best_epoch, since_best = -1.0, 0, 0
        best_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        history: list[dict[str, Any]] = []
        stopped = "max_epochs"
        for epoch in range(cfg.max_epochs):
            self.model.train()
            train_loss = self._epoch(epoch)
            if not np.isfinite(train_loss["total"]):
                raise TrainingDivergedError(
                    f"epoch {epoch + 1}: the training loss is {train_loss['total']} (diverged); "
                    "lower the learning rate or the loss weights")
            if self.scheduler is not None:
                self.scheduler.step()
            valid = validate(self.model, self.splits)
            score = float(np.mean([m["ndcg@10"] for m in valid.values()]))
            history.append({"epoch": epoch + 1, "loss": train_loss, "valid": valid,
                            "score": score, "elapsed_s": time.perf_counter() - started})
            if self.progress_bar:
                shown = " ".join(f"{d} {m['hr@10']:.4f}/{m['ndcg@10']:.4f}"
                                 for d, m in valid.items())
                tqdm.write(f"epoch {epoch + 1}: loss {train_loss['total']:.4f} "
                           f"valid HR/NDCG@10 {shown}")
            if score > best_score:
                best_score, best_epoch, since_best = score, epoch + 1, 0
                best_state = {k: v.clone() for k, v in self.model.state_dict().items()}
            else:
                since_best += 1
                if since_best >= cfg.patience:
                    stopped = "patience"
                    break
        self.model.load_state_dict(best_state)
        self.model.refresh()
        return TrainResult(self.model, best_epoch, best_score, time.perf_counter() - started,
                           stopped, history)


def _sequence(split: DomainSplit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A time-ordered split's training items in (user, time) order, each position's user-block
    start, and each training row's position in that order."""
    assert split.train_pos is not None, "a causal sequence needs the split's time order"
    users = split.train[:, 0]
    seq = np.lexsort((split.train_pos, users))
    ordered = users[seq]
    first = np.r_[True, ordered[1:] != ordered[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(ordered)), 0))
    where = np.empty(len(seq), dtype=np.int64)
    where[seq] = np.arange(len(seq))
    return (torch.from_numpy(split.train[seq, 1].astype(np.int64)),
            torch.from_numpy(start.astype(np.int64)), torch.from_numpy(where))
