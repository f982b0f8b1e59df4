"""``relaygr train``: train HSTU on an interaction dataset into a run directory.

    relaygr train --dataset ml-1m --data-dir DIR --out RUN_DIR [--preset quick|paper]
                  [--device cpu|cuda] [--seed N] [--resume] [--set key=value ...]
                  [--stage RUN]

``--stage RUN`` trains a ranker for the cascade whose retrieval stage is another run's retrieval
head: the ranking head's hard negatives come from that stage's top K, and the ranking phase keeps
the head that best orders the stage's proposals (``relaygr eval --retrieval RUN`` then measures
the cascade). Both are chosen on the ranker's validation users, so a stage that trained on any
of their targets is refused (``stage_runs``: other validation settings, or the same on other
data); where the stage's data cannot be read to tell, a warning says so.

The run directory receives the best model (safetensors), its JSON config, the id map, per-epoch
validation metrics and a resumable state (see ``relaygr.train.checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from relaygr.cli.config import as_plain, device_name, positive_int
from relaygr.data import DATASET_FILES, TableSpec, load_sequences
from relaygr.data.sequences import UserSequences
from relaygr.errors import CheckpointError, ConfigError
from relaygr.retrieval.checkpoint import RUN_INFO_FILE
from relaygr.train import (
    PRESETS,
    RankingMetrics,
    TrainConfig,
    Trainer,
    load_trained,
    preset,
    retrieval_ranks_padded,
)
from relaygr.train.evaluate import EXCLUSIONS
from relaygr.train.run_data import training_split
from relaygr.train.stage_runs import check_stage_held_out, load_stage_run
from relaygr.train.trainer import StageRun


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` strings → typed values (JSON when it parses, the bare string otherwise)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected key=value, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def parse_columns(text: str | None) -> TableSpec | None:
    """``user=u,item=i,timestamp=t,order=o`` → a ``TableSpec`` (unnamed columns keep defaults)."""
    if not text:
        return None
    names = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    unknown = sorted(set(names) - {"user", "item", "timestamp", "order"})
    if unknown or not names:
        raise ConfigError(f"--columns takes user=,item=,timestamp=,order=; got {text!r}")
    return TableSpec(**names)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", required=True, choices=sorted(DATASET_FILES),
                        help="dataset format / name")
    parser.add_argument("--data-dir", required=True, type=Path,
                        help="directory holding the dataset (or the data file itself)")
    parser.add_argument("--columns", default=None,
                        help="column names of a generic table, e.g. user=uid,item=iid,timestamp=ts")
    parser.add_argument("--device", type=device_name, default="cpu",
                        help="torch device (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's choice)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train HSTU on an interaction dataset",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, help="run directory to write")
    parser.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last completed epoch")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a TrainConfig field (repeatable)")
    parser.add_argument("--stage", type=Path, default=None, metavar="RUN",
                        help="train a ranker against this run's retrieval head (the cascade's "
                             "stage): hard negatives from its top K, the ranking phase "
                             "validated on its proposals")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run, effective_config=effective_config)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The preset with the ``--set`` overrides: what the run trains with."""
    return preset(args.preset).with_(**parse_overrides(args.overrides))


def effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """``relaygr config show train ...``: the run's TrainConfig and what else decides it."""
    return {"train": as_plain(train_config(args)),
            **as_plain({k: getattr(args, k) for k in ("preset", "seed", "dataset", "data_dir",
                                                      "device", "stage", "out")})}


def _stage(args: argparse.Namespace, seqs: UserSequences, config: TrainConfig,
           spec: TableSpec | None) -> StageRun:
    """``--stage``: the run, refused when it trained on any of the ranker's validation targets
    (``check_stage_held_out``; a warning where that cannot be measured)."""
    stage = load_stage_run(args.stage, args.device, seqs.id_map, config)
    held = check_stage_held_out(
        stage, seqs, training_split(seqs, config).valid,
        "the hard negatives and the ranking phase's head would be chosen on",
        "train the stage on this data with the ranker's valid_users and valid_seed", spec)
    if not held.measured:
        print(f"warning: what the stage trained on of the validation targets could not be "
              f"measured ({held.unverified}); it is used regardless", flush=True)
    return StageRun(stage.model, args.stage)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    config = train_config(args)
    if (Path(args.out) / RUN_INFO_FILE).is_file():
        raise CheckpointError(f"{args.out} holds a retrieval run (train-retrieval's "
                              f"{RUN_INFO_FILE}); train the ranker into another --out")
    started = time.perf_counter()
    spec = parse_columns(args.columns)
    seqs = load_sequences(args.dataset, args.data_dir, spec)
    print(f"{seqs.source}: {seqs.num_users} users, {seqs.num_items} items, "
          f"{seqs.num_events} interactions ({int(seqs.timed.sum())} users timed); "
          f"time features {'on' if config.use_timestamps else 'off'}", flush=True)
    stage = None if args.stage is None else _stage(args, seqs, config, spec)
    trainer = Trainer(config, seqs, args.out, dataset=args.dataset, preset=args.preset,
                      seed=args.seed, device=args.device, progress_bar=not args.no_progress,
                      stage=stage)
    result = trainer.fit(resume=args.resume)
    trained = load_trained(trainer.run_dir, args.device)   # the best epoch's weights
    test = {exclude: RankingMetrics.from_ranks(retrieval_ranks_padded(
        trained.model, seqs, trainer.split.test, config.max_seq_len, config.use_timestamps,
        exclude=exclude)) for exclude in EXCLUSIONS}
    wall_s = time.perf_counter() - started
    print(f"test (retrieval head, best epoch {result.progress.best_epoch}), whole history "
          f"removed: {test['history'].summary()}")
    print(f"test, only the {config.max_seq_len}-item window removed (the HSTU reference's "
          f"protocol): {test['window'].summary()}")
    train_s = result.progress.elapsed_s + result.progress.rank_phase_s
    print(f"training time {train_s / 60:.1f} min over all sessions; "
          f"this command {wall_s / 60:.1f} min; run directory {args.out}")
    return 0
