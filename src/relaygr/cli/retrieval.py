"""``relaygr train-retrieval`` / ``relaygr eval-retrieval``: the cascade's SCCDR retrieval stage.

    relaygr train-retrieval --pair sport_cloth --data-dir DIR --out RUN
                            [--preset sccdr|mixed|single|lightgcn] [--split cvgae|disencdr]
                            [--seeds 0 1 2] [--add-seeds] [--set key=value ...] [--threads N]
    relaygr eval-retrieval --checkpoint RUN --protocol cvgae|disencdr|full --json PATH
                           [--baseline NAME=RUN ...]

``--dataset ml-1m --data-dir ML1M_DIR`` trains the single-domain variant on MovieLens-1M
(leave-one-out; use ``--preset single --set lambda_intra=0.1`` for intra-CL + matching loss).

``--pair a_b`` names the target domain's folder; its partner ``b_a`` is read beside it. Each seed
gets its own split (fixed-seed negatives, written to ``RUN/seed-<s>/split``) and model;
``--add-seeds`` trains further seeds into an existing run of the same data, preset and config. The
``full`` protocol ranks a run's own test rows (either split) against the whole catalogue.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from relaygr.cli.config import as_plain, check_output_file, positive_int
from relaygr.cli.train import parse_overrides
from relaygr.errors import CheckpointError, ConfigError
from relaygr.retrieval.checkpoint import (
    RUN_INFO_FILE,
    RunInfo,
    finished_seeds,
    read_run_info,
    save_catalogue,
    save_result,
    save_splits,
    with_added_seeds,
    write_run_info,
)
from relaygr.retrieval.config import PRESETS, SCCDRConfig, preset
from relaygr.retrieval.data import Domain, load_pair
from relaygr.retrieval.movielens import load_movielens
from relaygr.retrieval.report import report
from relaygr.retrieval.splits import Protocol, SplitKind, make_split
from relaygr.retrieval.trainer import RetrievalTrainer
from relaygr.train.checkpoint import CONFIG_FILE


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train-retrieval", help="train the SCCDR retrieval model",
                                  description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--dataset", default="amazon-pair", choices=["amazon-pair", "ml-1m"],
                       help="a cross-domain pair (default) or MovieLens-1M as one domain")
    train.add_argument("--pair", default=None, help="target_source folder, e.g. sport_cloth")
    train.add_argument("--data-dir", required=True, type=Path,
                       help="folder holding the pair folders (amazon-disencdr)")
    train.add_argument("--out", required=True, type=Path, help="run directory to write")
    train.add_argument("--preset", default="sccdr", choices=sorted(PRESETS))
    train.add_argument("--split", default="cvgae", choices=[k.value for k in SplitKind])
    train.add_argument("--seeds", type=int, nargs="+", default=[0])
    train.add_argument("--add-seeds", action="store_true",
                       help="add --seeds to the run already at --out (same pair, split, preset, "
                            "config and data; its seeds are kept)")
    train.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override an SCCDRConfig field (repeatable)")
    train.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.set_defaults(func=run_train, effective_config=effective_config)
    ev = subparsers.add_parser("eval-retrieval", help="evaluate a retrieval run and baselines",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("--checkpoint", required=True, type=Path, help="run directory")
    ev.add_argument("--protocol", required=True, choices=[p.value for p in Protocol])
    ev.add_argument("--json", type=Path, default=None, help="write the report here")
    ev.add_argument("--baseline", action="append", default=[], metavar="NAME=RUN",
                    help="a trained baseline run on the same splits (repeatable)")
    ev.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    ev.set_defaults(func=run_eval)


def retrieval_config(args: argparse.Namespace) -> SCCDRConfig:
    """The preset with the ``--set`` overrides: what ``train-retrieval`` trains with."""
    return preset(args.preset).with_(**parse_overrides(args.overrides))


def effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """``relaygr config show train-retrieval ...``: the SCCDRConfig and the data it reads."""
    return {"retrieval": as_plain(retrieval_config(args)),
            **as_plain({k: getattr(args, k) for k in ("preset", "dataset", "pair", "data_dir",
                                                      "split", "seeds", "out")})}


def run_train(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    cfg = retrieval_config(args)
    if args.dataset == "ml-1m":
        if args.pair is not None:
            raise ConfigError("--pair names an Amazon pair (--dataset amazon-pair); ml-1m is "
                              "one domain")
        pair, name = load_movielens(args.data_dir), "ml-1m"
        domains: tuple[Domain, ...] = pair.domains[:1]
    elif args.pair is None:
        raise ConfigError("--pair is required for --dataset amazon-pair")
    else:
        pair, name = load_pair(args.data_dir, args.pair), args.pair
        domains = pair.domains
    kind = SplitKind(args.split)
    names = tuple(d.name for d in domains)
    info = RunInfo(name, names, pair.num_users, kind, args.preset, cfg, tuple(args.seeds),
                   {"data_dir": str(args.data_dir), **pair.summary()})
    # run.json lists the seeds that finished, written after each: an interrupted command
    # leaves the run it added to (or nothing) as it was, and running it again with
    # --add-seeds trains the seeds it has not finished
    finished: tuple[int, ...] = ()
    seeds = tuple(args.seeds)
    if (args.out / CONFIG_FILE).is_file():
        raise CheckpointError(f"{args.out} holds a ranking run (train's {CONFIG_FILE}); train "
                              "the retrieval stage into another --out")
    if args.add_seeds:
        finished = finished_seeds(args.out)
        done = [s for s in seeds if s in finished]
        seeds = tuple(s for s in seeds if s not in finished)
        with_added_seeds(args.out, replace(info, seeds=seeds))     # checks config and data
        if done:
            print(f"seed(s) {done} already finished in {args.out}: not trained again",
                  flush=True)
        if not seeds:
            return 0
    elif (args.out / RUN_INFO_FILE).is_file():
        raise CheckpointError(f"{args.out} already holds a retrieval run (seeds "
                              f"{list(read_run_info(args.out).seeds)}); pass --add-seeds to "
                              "train the seeds it lacks into it (its config and data must "
                              "match), or choose another --out")
    save_catalogue(args.out, pair, names)
    print(f"{name}: {pair.num_users} users; " + "; ".join(
        f"{d.name} {d.num_items} items, {len(d.train)} train" for d in domains), flush=True)
    for seed in seeds:
        started = time.perf_counter()
        splits = {d.name: make_split(d, kind, seed, cfg.valid_share) for d in domains}
        save_splits(args.out, seed, splits)
        trainer = RetrievalTrainer(cfg, splits, pair.num_users, seed,
                                   progress_bar=not args.no_progress)
        result = trainer.fit()
        save_result(args.out, seed, result)
        finished += (seed,)
        write_run_info(args.out, replace(info, seeds=finished))
        valid = result.history[result.best_epoch - 1]["valid"]
        shown = " ".join(f"{d} {m['hr@10']:.4f}/{m['ndcg@10']:.4f}" for d, m in valid.items())
        print(f"seed {seed}: best epoch {result.best_epoch} ({result.stopped}), valid "
              f"HR/NDCG@10 {shown}; {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    return 0


def parse_baselines(pairs: list[str]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--baseline takes NAME=RUN; got {pair!r}")
        out[name] = Path(path)
    return out


def run_eval(args: argparse.Namespace) -> int:
    check_output_file(args.json)
    torch.set_num_threads(args.threads)
    result = report(args.checkpoint, Protocol.parse(args.protocol),
                    parse_baselines(args.baseline))
    rows = [("model (" + result["model_preset"] + ")", result["model"]),
            *result["baselines"].items(), *result["fused"].items()]
    for name, metrics in rows:
        shown = "; ".join(d + " " + " ".join(f"{k} {v:.4f}±{m[k + '_std']:.4f}"
                                             for k, v in m.items() if not k.endswith("_std"))
                          for d, m in metrics.items())
        print(f"{name:>18}: {shown}")
    print("model+itemcf weight by seed (chosen on validation): " + ", ".join(
        f"{seed} {w:g}" for seed, w in result["fusion_weights"].items()))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0
