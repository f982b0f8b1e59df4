"""The training loop: epochs of joint retrieval + ranking loss, validation, early stopping.

Per batch: the retrieval sampled softmax over every position (``losses.retrieval_loss``) plus
``rank_weight`` times the ranking-head softmax at a random cut of ``rank_users`` users
(``losses.ranking_loss``; with ``rank_trains="head"`` it trains the head's MLP alone; with
``rank_hard_negatives`` some negatives come from the retrieval head's top K, ``mining``), one
AdamW step at the scheduled learning rate (constant or cosine, times the plateau scale). After every
``eval_every_epochs`` epochs the retrieval head is validated on the leave-one-out validation items
(NDCG@10 decides); a better score overwrites ``model.safetensors``, and ``patience`` validations
without one stop the run. Every epoch ends with a resumable checkpoint
(``checkpoint.save_train_state``), so ``resume`` continues bit-for-bit where the last completed
epoch ended (same device and thread count). A resumed run decides whether it goes on as it did
when it stopped (the saved last epoch's time included): with the same schedule a finished run
trains nothing; a changed schedule (``SCHEDULE_FIELDS``) may reopen it.

With ``rank_phase_epochs``, the ranking phase (``rank_phase``) follows the schedule: the ranking
head alone, with hard negatives, on a copy of the schedule's best weights read from
``schedule/best.safetensors``, with its own generator and torch seed from the run's seed; the
saved model then carries the head of the best validated cascade. The phase changes nothing the
schedule goes on from (the state keeps the last epoch's weights, optimizer and sampling state,
and records only that the phase ran), so an interrupted phase redone gives the same result, and
a run resumed with more epochs runs the phase again after them: it ends as the run of that many
epochs without a stop would.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from relaygr.data.sequences import UserSequences
from relaygr.data.servable import check_times, check_user_ids
from relaygr.data.split import LeaveOneOutSplit
from relaygr.errors import CheckpointError, ConfigError, TrainingDivergedError
from relaygr.model import HSTU
from relaygr.train.batches import BATCH_ORDERS, BatchOrder, TrainingData
from relaygr.train.checkpoint import (
    CONFIG_FILE,
    DatasetInfo,
    RunConfig,
    TrainProgress,
    has_train_state,
    has_weights,
    load_schedule_best,
    load_train_state,
    read_run_config,
    save_model,
    save_run_files,
    save_schedule_best,
    save_train_state,
    write_run_config,
)
from relaygr.train.config import TrainConfig
from relaygr.train.evaluate import CascadeSpec, retrieval_ranks_padded, serving_ranks
from relaygr.train.losses import ranking_loss, retrieval_loss
from relaygr.train.metrics import CUTOFFS, RankingMetrics
from relaygr.train.metrics_log import PHASE_KEY, MetricsLog
from relaygr.train.mining import with_hard_negatives
from relaygr.train.rank_phase import RankPhase
from relaygr.train.run_data import training_split
from relaygr.train.stages import CheckpointRetrieval, HeadRetrieval, RetrievalStage

Log = Callable[[str], None]

# TrainConfig fields a resumed run may change: how long it goes on, not what it trains.
SCHEDULE_FIELDS = ("max_epochs", "patience", "time_budget_s", "lr_decay", "lr_decay_patience")


def _print(message: str) -> None:
    print(message, flush=True)


@dataclass(frozen=True)
class TrainResult:
    """How a run ended: its directory, final progress, and the best validation metrics."""

    run_dir: Path
    progress: TrainProgress
    best_valid: RankingMetrics | None


@dataclass(frozen=True)
class StageRun:
    """The cascade's retrieval stage a ranker is trained against: another run's model (its
    retrieval head proposes; its top ``rank_mine_k`` give the hard negatives and the ranking
    phase's validated cascade) and the directory it was loaded from (recorded in the run)."""

    model: HSTU
    run_dir: Path


class Trainer:
    """One training run of ``config`` on ``sequences`` into ``run_dir`` (see the module doc)."""

    def __init__(self, config: TrainConfig, sequences: UserSequences, run_dir: Path, *,
                 dataset: str, preset: str = "custom", seed: int = 0,
                 device: torch.device | str = "cpu", progress_bar: bool = True,
                 log: Log = _print, stage: StageRun | None = None) -> None:
        if config.use_timestamps and not sequences.timed.any():
            raise ConfigError(f"use_timestamps: no user of {sequences.source} has timestamps")
        if config.use_timestamps and not sequences.all_timed and not config.time_where_known:
            raise ConfigError(f"use_timestamps needs a timestamp on every event; "
                              f"{int((~sequences.timed).sum())} users of {sequences.source} "
                              "have none (time_where_known=true trains them without time)")
        # a checkpoint serves the data it was trained on, so what serving refuses of it is
        # refused here, before a model nothing could serve is trained (data.servable)
        check_user_ids(sequences.source, sequences.user_ids)
        if config.use_timestamps:
            check_times(sequences)
        self.cfg, self.seqs, self.run_dir = config, sequences, Path(run_dir)
        self.device, self.progress_bar, self.log = torch.device(device), progress_bar, log
        split = training_split(sequences, config)
        if config.rank_hard_negatives and (
                config.rank_mine_k + config.max_seq_len > sequences.num_items):
            raise ConfigError(f"rank_mine_k ({config.rank_mine_k}) + max_seq_len "
                              f"({config.max_seq_len}) exceeds the {sequences.num_items} items: "
                              "a history could leave fewer than rank_mine_k items to mine")
        self.split: LeaveOneOutSplit = split
        model_config = config.model_config(sequences.num_items)
        self.data = TrainingData(self.split, config.max_seq_len, config.use_timestamps)
        torch.manual_seed(seed)
        self.model = HSTU(model_config).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate,
                                           betas=(0.9, config.adam_beta2),
                                           weight_decay=config.weight_decay)
        self.gen = torch.Generator().manual_seed(seed)
        self.order: BatchOrder = BATCH_ORDERS[config.batch_order]()
        self.run = RunConfig(self.model.cfg, config, DatasetInfo.of(dataset, sequences), seed,
                             preset, None if stage is None else str(stage.run_dir))
        # hard negatives come from the cascade's retrieval stage: a separate run's head, or
        # this model's own
        self.stage = stage
        self.miner = self.model if stage is None else stage.model.to(self.device).eval()
        if self.miner.cfg.num_items != self.model.cfg.num_items:
            raise ConfigError(f"the stage numbers {self.miner.cfg.num_items} items, this data "
                              f"{self.model.cfg.num_items}")

    # ---- one epoch ---------------------------------------------------------------------------

    def train_epoch(self, progress: TrainProgress) -> dict[str, float]:
        """One pass over the training users; returns the mean losses."""
        cfg, model = self.cfg, self.model
        model.train()
        batches = self.data.epoch(self.order, cfg.batch_size, self.gen)
        sums = {"loss": 0.0, "retrieval": 0.0, "ranking": 0.0}
        bar = tqdm(batches, desc=f"epoch {progress.epoch + 1}", unit="batch", leave=False,
                   disable=not self.progress_bar, mininterval=2.0)
        total_steps = cfg.max_epochs * len(batches)
        # loss_mean "epoch": every position weighs the same whichever batch it lands in
        denominator = (float(self.data.lengths.sum()) / len(batches)
                       if cfg.loss_mean == "epoch" else None)
        for rows in bar:
            if cfg.lr_schedule == "cosine":
                self._set_lr(progress, total_steps)
            batch = self.data.batch(rows).to(self.device)
            retrieval = retrieval_loss(model, batch, cfg.num_negatives, cfg.negative_sharing,
                                       self.gen, denominator)
            loss, ranking = retrieval, torch.zeros(())
            if cfg.rank_weight > 0:
                rank = self.data.rank_batch(rows, cfg.rank_users, cfg.rank_negatives, self.gen)
                rank = with_hard_negatives(self.miner, rank.to(self.device),
                                           cfg.rank_hard_negatives, cfg.rank_mine_k, self.gen,
                                           reads_time=self.miner is model)
                ranking = ranking_loss(model, rank, cfg.rank_temperature,
                                       cfg.rank_trains == "head")
                loss = retrieval + cfg.rank_weight * ranking
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            progress.step += 1
            for key, value in (("loss", loss), ("retrieval", retrieval), ("ranking", ranking)):
                sums[key] += float(value.detach())
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", refresh=False)
        return {k: v / len(batches) for k, v in sums.items()}

    def validate(self) -> RankingMetrics:
        ranks = retrieval_ranks_padded(self.model, self.seqs, self.split.valid,
                                       self.cfg.max_seq_len, self.cfg.use_timestamps)
        return RankingMetrics.from_ranks(ranks)

    # ---- the run -----------------------------------------------------------------------------

    def _start(self, resume: bool) -> TrainProgress:
        """The progress the session starts from, and its ``metrics.jsonl`` writer."""
        progress = self._resume() if resume else self._begin()
        self.metrics = MetricsLog(self.run_dir, progress)
        return progress

    def _resume(self) -> TrainProgress:
        """The saved run's progress, whether it goes on decided under the schedule given now
        (module docstring); ``CheckpointError`` when its config, data or seed changed."""
        saved = read_run_config(self.run_dir)
        self.run = replace(self.run, dataset=_as_recorded(self.run.dataset, saved.dataset))
        if _resumable(saved) != _resumable(self.run):
            changed = _differences(_resumable(saved).to_dict(), _resumable(self.run).to_dict())
            raise CheckpointError(
                f"{self.run_dir} was trained with a different config, dataset or seed ("
                + "; ".join(f"{key}: trained {was!r}, now {now!r}" for key, was, now in changed)
                + "); resume with the arguments it was trained with (a preset that changed "
                "since: --set KEY=VALUE as trained; only "
                f"{', '.join(SCHEDULE_FIELDS)} may change)")
        if not has_train_state(self.run_dir) and not has_weights(self.run_dir):
            self.log("no epoch of this run finished: it starts from its first")
            write_run_config(self.run_dir, self.run)
            return TrainProgress()
        progress = load_train_state(self.run_dir, self.model, self.optimizer, self.gen)
        if saved != self.run:  # a new schedule: record it, keep the best weights
            write_run_config(self.run_dir, self.run)
        # decided as the run decided after its last epoch, under the schedule given now
        next_epoch_s = progress.epoch_s
        if next_epoch_s is None:   # saved before runs recorded it: the mean epoch's
            next_epoch_s = progress.elapsed_s / max(progress.epoch, 1)
        progress.stopped = self._stop_reason(progress, next_epoch_s)
        if not progress.stopped and progress.rank_phase_done:
            # more epochs: the phase follows them again, on their best
            progress.rank_phase_done, progress.rank_phase_s = False, 0.0
        self._set_lr(progress)
        return progress

    def _begin(self) -> TrainProgress:
        """A new run's progress, its files written; ``CheckpointError`` over another run."""
        if (self.run_dir / CONFIG_FILE).exists():
            raise CheckpointError(f"{self.run_dir} already holds a run; pass resume to continue "
                                  "it or choose another directory")
        # no weights yet: they are written at the first validation, so a run stopped before
        # it is never mistaken for a trained one (checkpoint.load_trained refuses it)
        save_run_files(self.run_dir, self.run, self.seqs.id_map)
        return TrainProgress()

    def _after_validation(self, progress: TrainProgress, metrics: RankingMetrics,
                          losses: dict[str, float]) -> None:
        ndcg = metrics.ndcg[10]
        record = {"epoch": progress.epoch, "step": progress.step,
                  "lr": self.optimizer.param_groups[0]["lr"],
                  "elapsed_s": round(progress.elapsed_s, 1), **losses,
                  **{f"valid_{k}": v for k, v in metrics.to_dict().items()}}
        if ndcg > progress.best_ndcg:
            progress.best_ndcg, progress.best_epoch = ndcg, progress.epoch
            progress.evals_since_best = progress.evals_since_decay = 0
            if self.cfg.rank_phase_epochs:
                save_schedule_best(self.run_dir, self.model)
            save_model(self.run_dir, self.model, self.run, self.seqs.id_map)
        else:
            progress.evals_since_best += 1
            progress.evals_since_decay += 1
            if self.cfg.lr_decay < 1 and progress.evals_since_decay >= self.cfg.lr_decay_patience:
                progress.lr_scale *= self.cfg.lr_decay
                progress.evals_since_decay = 0
                self._set_lr(progress)
        progress.history.append(record)
        self.metrics.append([record])

    def _set_lr(self, progress: TrainProgress, total_steps: int | None = None) -> None:
        lr = self.cfg.learning_rate * progress.lr_scale
        if self.cfg.lr_schedule == "cosine" and total_steps:
            lr *= cosine_factor(progress.step, total_steps, self.cfg.lr_min_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _stop_reason(self, progress: TrainProgress, epoch_s: float,
                     elapsed_s: float | None = None) -> str:
        """Why the run stops after this epoch ("" if it goes on); ``elapsed_s`` defaults to
        the progress's, ``epoch_s`` is the time the next epoch is expected to take."""
        elapsed = progress.elapsed_s if elapsed_s is None else elapsed_s
        if progress.evals_since_best >= self.cfg.patience:
            return f"early stop: no better validation NDCG@10 in {self.cfg.patience} validations"
        if progress.epoch >= self.cfg.max_epochs:
            return f"reached max_epochs ({self.cfg.max_epochs})"
        if elapsed + epoch_s > self.cfg.time_budget_s:
            return f"time budget ({self.cfg.time_budget_s:.0f} s) would be exceeded"
        return ""

    def fit(self, resume: bool = False) -> TrainResult:
        progress = self._start(resume)
        if progress.stopped:
            self.log(f"run already finished: {progress.stopped}")
        while not progress.stopped:
            started = time.perf_counter()
            losses = self.train_epoch(progress)
            if not math.isfinite(losses["loss"]):
                raise TrainingDivergedError(
                    f"epoch {progress.epoch + 1}: the training loss is {losses['loss']} "
                    "(diverged); the last finished epoch's state is kept: resume with a lower "
                    "learning rate")
            progress.epoch += 1
            lr = self.optimizer.param_groups[0]["lr"]
            line = (f"epoch {progress.epoch} step {progress.step} lr {lr:.2g} "
                    f"loss {losses['loss']:.4f} "
                    f"(retrieval {losses['retrieval']:.4f} ranking {losses['ranking']:.4f})")
            train_s = time.perf_counter() - started
            # The schedule's last epoch is always validated: else a run that stops between
            # validations (max_epochs or the time budget) would keep an older best, epoch 0's
            # untrained weights if it never validated at all.
            last = bool(self._stop_reason(progress, train_s, progress.elapsed_s + train_s))
            if last or progress.epoch % self.cfg.eval_every_epochs == 0:
                metrics = self.validate()
                progress.elapsed_s += time.perf_counter() - started
                self._after_validation(progress, metrics, losses)
                line += f" | valid {metrics.summary()}"
            else:
                progress.elapsed_s += time.perf_counter() - started
            epoch_s = progress.epoch_s = time.perf_counter() - started
            progress.stopped = self._stop_reason(progress, epoch_s)
            save_train_state(self.run_dir, self.model, self.optimizer, progress, self.gen)
            self.log(f"{line} | {epoch_s:.0f} s/epoch, {progress.elapsed_s / 60:.1f} min total")
        self.log(f"stopped: {progress.stopped}; best validation NDCG@10 "
                 f"{progress.best_ndcg:.4f} at epoch {progress.best_epoch}")
        if self.cfg.rank_phase_epochs and not progress.rank_phase_done:
            self._rank_phase(progress)
        best = next((h for h in progress.history if h["epoch"] == progress.best_epoch), None)
        best_metrics = None if best is None else _metrics_from_record(best)
        return TrainResult(self.run_dir, progress, best_metrics)

    def _validate_cascade(self, model: HSTU) -> RankingMetrics:
        """The cascade of ``model`` on the validation items: the stage's (without one,
        ``model``'s own retrieval head's) top ``rank_mine_k``, ranked by ``model``."""
        stage: RetrievalStage = (HeadRetrieval(model) if self.stage is None
                                 else CheckpointRetrieval(self.miner))
        spec = CascadeSpec(stage, self.cfg.rank_mine_k)
        ranks = serving_ranks(model, self.seqs, self.split.valid, self.cfg.max_seq_len,
                              self.cfg.use_timestamps, ("cascade",), cascade=spec)
        return RankingMetrics.from_ranks(ranks["cascade"])

    def _rank_phase(self, progress: TrainProgress) -> None:
        """The ranking phase (``rank_phase``) on a copy of the schedule's best weights, with
        its own randomness; saves the model with the best validated head and records that the
        phase ran in the progress (the state's weights, optimizer and generator stay the
        schedule's)."""
        started = time.perf_counter()
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):     # the schedule's torch RNG state stays
            torch.manual_seed(self.run.seed)
            model = HSTU(self.model.cfg).to(self.device)
            load_schedule_best(self.run_dir, model)
            gen = torch.Generator().manual_seed(self.run.seed)
            miner = model if self.stage is None else self.miner
            phase = RankPhase(self.cfg, model, self.data, gen,
                              lambda: self._validate_cascade(model), miner)
            epochs = phase.run(self.order, self.log)
        save_model(self.run_dir, model, self.run, self.seqs.id_map)
        self.metrics.append([{PHASE_KEY: e.epoch, "ranking": e.loss,
                              **{f"valid_cascade_{k}": v for k, v in e.valid.to_dict().items()}}
                             for e in epochs])
        progress.rank_phase_done = True
        progress.rank_phase_s = time.perf_counter() - started
        save_train_state(self.run_dir, self.model, self.optimizer, progress, self.gen)
        self.log(f"ranking phase done in {progress.rank_phase_s / 60:.1f} min")


def cosine_factor(step: int, total_steps: int, min_ratio: float) -> float:
    """Cosine decay from 1 at step 0 to ``min_ratio`` at ``total_steps`` (and after)."""
    done = min(1.0, step / total_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * done))


def _as_recorded(dataset: DatasetInfo, saved: DatasetInfo) -> DatasetInfo:
    """``dataset`` without the fingerprints ``saved`` (the run's record, saved before runs
    recorded them) lacks: its earlier sessions' rows or sequences are not known, so the run goes
    on recording its data without them (by the counts alone when it has neither)."""
    if saved.fingerprint is None:
        dataset = replace(dataset, fingerprint=None)
    if saved.sequence_fingerprint is None:
        dataset = replace(dataset, sequence_fingerprint=None)
    return dataset


def _differences(was: dict[str, Any], now: dict[str, Any], prefix: str = ""
                 ) -> list[tuple[str, Any, Any]]:
    """``(dotted key, was, now)`` for every leaf where two nested dicts differ."""
    out = []
    for key in sorted(set(was) | set(now), key=str):
        a, b = was.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append((f"{prefix}{key}", a, b))
    return out


def _resumable(run: RunConfig) -> RunConfig:
    """What must not change between the sessions of a run (the schedule may)."""
    return replace(run, train=run.train.with_(**{f: getattr(TrainConfig(), f)
                                                 for f in SCHEDULE_FIELDS}))


def _metrics_from_record(record: dict[str, float]) -> RankingMetrics:
    return RankingMetrics(hr={k: record[f"valid_hr@{k}"] for k in CUTOFFS},
                          ndcg={k: record[f"valid_ndcg@{k}"] for k in CUTOFFS},
                          mrr=record["valid_mrr"], num_cases=int(record["valid_num_cases"]))
