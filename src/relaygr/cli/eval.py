"""``relaygr eval``: full-catalogue evaluation of a trained run on its held-out items.

    relaygr eval --checkpoint RUN_DIR --dataset ml-1m --data-dir DIR [--json PATH]
                 [--split test|valid] [--heads retrieval,ranking,cascade]
                 [--retrieval head|item-embeddings|RUN] [--retrieve-k 200]
                 [--retrieval-history N] [--retrieval-recency R] [--users N [--seed S]]
                 [--stage-weight W | --fit-stage-weight] [--exclude history|window]

Every user's held-out item is ranked against the whole catalogue with the user's history
removed (``--exclude window``: only the last max_seq_len items the model reads, the protocol of
the HSTU paper's open-source evaluation, under which its published figures were measured; the
retrieval and ranking heads and popularity); HR@10/50/200, NDCG@10/50/200 and MRR are reported
for the retrieval head, the ranking head (the whole catalogue scored as candidates against each
user's prefilled K/V: the relay pattern, offline), the cascade (the retrieval stage's top K,
ranked by the ranking head against the prefilled K/V; an item retrieval missed ranks below all
K) with the stage's recall@K, and a popularity baseline. The cascade ranks by the ranker's
score plus ``--stage-weight`` times the stage's (``--fit-stage-weight`` chooses it on the run's
validation users). Without ``--checkpoint`` only the baseline runs. ``--split valid`` of a run
that held out the validation item of some users only (``valid_users``) evaluates those users. A
run as the stage (a retrieval run, or an HSTU run read from the data it records) is checked
against the evaluated targets: the share it trained on is printed and recorded
(``targets_in_run_training``; null, and a warning, where an HSTU run's data cannot be read); so
is the ranking run's own (``checkpoint_held_out``, evaluated on other data than it records, it
may have trained on every head's targets).

The evaluated data gets the checks of ``relaygr.data.servable`` that training and serving make,
with the same errors, where they apply here: for a model that reads time, every user timed
(at least one, for a run that trained untimed users without time: ``time_where_known``),
with unix seconds in 0..2^40 in its sequence's order (``check_times``; a model would otherwise
be measured on times it was never trained or served with); with a retrieval run as the stage,
user ids the integers serving names users by (``TrainedRunStage.load``: the run looks a user up
by that id, as serve does).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from relaygr.cli.config import check_output_file
from relaygr.cli.eval_stages import (
    EmbeddingStage,
    HstuRunStage,
    TrainedRunStage,
    stage_from_args,
)
from relaygr.cli.train import add_data_arguments, parse_columns
from relaygr.data import check_times, leave_one_out, load_sequences
from relaygr.data.sequences import UserSequences
from relaygr.data.split import LeaveOneOutSplit
from relaygr.errors import ConfigError
from relaygr.train import (
    CUTOFFS,
    RankingMetrics,
    TrainedModel,
    load_trained,
    popularity_ranks,
    serving_ranks,
)
from relaygr.train.evaluate import (
    DEFAULT_RETRIEVE_K,
    EXCLUSIONS,
    HEADS,
    CascadeSpec,
    subset_cases,
)
from relaygr.train.fusion import StageWeightFit, fit_stage_weight
from relaygr.train.metrics import PairedDifference
from relaygr.train.run_data import HeldOutCheck, check_held_out, training_split
from relaygr.train.stage_runs import check_stage_held_out

HEAD_CHOICES = HEADS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="evaluate a trained run (full-catalogue ranking)",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=None, help="run directory")
    add_data_arguments(parser)
    parser.add_argument("--split", choices=("test", "valid"), default="test")
    parser.add_argument("--heads", default=None,
                        help="comma-separated heads to evaluate (retrieval, ranking, cascade; "
                             "default: all of them, retrieval and ranking with --exclude "
                             "window)")
    parser.add_argument("--exclude", choices=EXCLUSIONS, default="history",
                        help="what a recommendation may not contain: the user's whole history "
                             "(as serving), or the window the model reads (its last "
                             "max_seq_len items: the HSTU reference's protocol; not with the "
                             "cascade, whose stage never proposes a seen item)")
    parser.add_argument("--retrieval", default="head",
                        help="the cascade's retrieval stage: head (the model's own retrieval "
                             "head), item-embeddings (relaygr serve's default stage: the model's "
                             "item embeddings, the user the recency-weighted mean of its latest "
                             "events'), an HSTU "
                             "run directory whose retrieval head proposes (a separate model over "
                             "the same item ids), or a retrieval run (relaygr train-retrieval) "
                             "on the same dataset")
    parser.add_argument("--retrieve-k", type=int, default=DEFAULT_RETRIEVE_K,
                        help="items the retrieval stage proposes to the ranker")
    parser.add_argument("--retrieval-history", type=int, default=None,
                        help="latest events the user vector of item-embeddings or a retrieval "
                             "run reads (default: serve's, StagesConfig.retrieval_history)")
    parser.add_argument("--retrieval-recency", type=float, default=None,
                        help="in (0, 1]: the k-th newest of those events weighs this ** k in "
                             "the user's mean (default: serve's, StagesConfig.retrieval_recency; "
                             "1: the plain mean)")
    parser.add_argument("--retrieval-run-share", type=float, default=None,
                        help="in (0, 1]: with a retrieval run, the share of the proposals its "
                             "tower makes, the rest item-embeddings', interleaved (default: "
                             "serve's, StagesConfig.retrieval_run_share; 1: the run alone)")
    parser.add_argument("--retrieval-item-cf-rest-share", type=float, default=None,
                        help="in [0, 1]: with a retrieval run, of the proposals its tower "
                             "leaves, the share the item-to-item channel of its training "
                             "interactions makes, the rest item-embeddings' (default: serve's, "
                             "StagesConfig.retrieval_item_cf_rest_share; 0: no such channel)")
    parser.add_argument("--stage-weight", type=float, default=0.0,
                        help="the cascade ranks by ranker score + this x the stage's score "
                             "(default 0: the ranker alone)")
    parser.add_argument("--fit-stage-weight", action="store_true",
                        help="choose --stage-weight on the run's validation users (best "
                             "NDCG@10 of a grid), then evaluate with it")
    parser.add_argument("--users", type=int, default=None,
                        help="evaluate a seeded subset of this many users (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --users subset")
    parser.add_argument("--batch-users", type=int, default=8,
                        help="users prefilled and ranked together")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def _heads(text: str | None, exclude: str) -> tuple[str, ...]:
    if text is None:
        return HEAD_CHOICES if exclude == "history" else ("retrieval", "ranking")
    heads = tuple(h for h in text.split(",") if h)
    if not heads or set(heads) - set(HEAD_CHOICES):
        raise ConfigError(f"--heads takes a comma-separated subset of {HEAD_CHOICES}")
    if "cascade" in heads and exclude != "history":
        raise ConfigError("the cascade removes the whole history, as serving does (its stage "
                          "never proposes a seen item): evaluate it without --exclude window")
    return heads


def _table(results: dict[str, RankingMetrics], title: str) -> Table:
    table = Table(title=title)
    table.add_column("head", no_wrap=True)
    columns = [f"HR@{k}" for k in CUTOFFS] + [f"NDCG@{k}" for k in CUTOFFS] + ["MRR"]
    for column in columns:
        table.add_column(column, justify="right")
    for head, m in results.items():
        values = [m.hr[k] for k in CUTOFFS] + [m.ndcg[k] for k in CUTOFFS] + [m.mrr]
        table.add_row(head, *(f"{v:.4f}" for v in values))
    return table


def _check_timed(trained: TrainedModel, seqs: UserSequences) -> None:
    """For a model that reads time, what training requires of ``seqs`` (every user timed,
    unless it trained untimed users without time: ``TrainConfig.time_where_known``) and what
    training and serving check of it (``check_times``); nothing for a position-only one."""
    if not trained.uses_timestamps:
        return
    if trained.run.train.time_where_known:
        if not seqs.timed.any():
            raise ConfigError(f"the model reads time where users have it, but no user of "
                              f"{seqs.source} has timestamps: it would be measured untimed")
        if not seqs.all_timed:
            print(f"note: {int((~seqs.timed).sum())} of {seqs.num_users} users have no "
                  "timestamps and are evaluated without time (the run's time_where_known)")
    elif not seqs.all_timed:
        raise ConfigError(f"the model reads time (trained with use_timestamps), but "
                          f"{int((~seqs.timed).sum())} users of {seqs.source} have an event "
                          "without a timestamp: evaluate it on data where every event is timed")
    check_times(seqs)


def _split_for(args: argparse.Namespace, trained: TrainedModel | None,
               seqs: UserSequences) -> LeaveOneOutSplit:
    """The run's own validation users under ``--split valid`` (see the module docstring)."""
    if trained is None or args.split != "valid":
        return leave_one_out(seqs)
    return training_split(seqs, trained.run.train)


def _fit(args: argparse.Namespace, trained: TrainedModel, seqs: UserSequences,
         cascade: CascadeSpec) -> StageWeightFit:
    """``--fit-stage-weight``: the grid on the run's validation users, printed."""
    if args.split != "test":
        raise ConfigError("--fit-stage-weight chooses the weight on the validation users; "
                          "report it on --split test")
    valid = training_split(seqs, trained.run.train).valid
    if isinstance(cascade.stage, HstuRunStage):
        held = check_stage_held_out(
            cascade.stage.run, seqs, valid, "the weight would be chosen on",
            "choose it with a stage that holds out the ranker's validation users, or give "
            "--stage-weight", parse_columns(args.columns))
        if held.share is None:
            print(f"warning: what the stage trained on of the validation targets could not be "
                  f"measured ({held.unverified}); the weight is chosen on them regardless")
    fit = fit_stage_weight(trained.model, seqs, valid, trained.model.cfg.max_seq_len,
                           trained.uses_timestamps, cascade, batch_users=args.batch_users,
                           progress=not args.no_progress)
    print(f"stage weight on {len(valid)} validation users (HR@10 / NDCG@10): " + ", ".join(
        f"{w:g}: {m.hr[10]:.4f} / {m.ndcg[10]:.4f}" for w, m in fit.metrics.items())
        + f"; chosen {fit.best:g}")
    return fit


def run(args: argparse.Namespace) -> int:
    check_output_file(args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    heads = _heads(args.heads, args.exclude)
    if args.exclude == "window" and args.checkpoint is None:
        raise ConfigError("--exclude window removes the window of the checkpoint's model (its "
                          "max_seq_len): give --checkpoint")
    if args.fit_stage_weight and ("cascade" not in heads or args.stage_weight):
        raise ConfigError("--fit-stage-weight chooses the cascade's stage weight: it needs the "
                          "cascade head (--heads ...,cascade) and no --stage-weight of its own")
    trained = None if args.checkpoint is None else load_trained(args.checkpoint, args.device)
    id_map = None if trained is None else trained.id_map
    seqs = load_sequences(args.dataset, args.data_dir, parse_columns(args.columns), id_map)
    if trained is not None:
        _check_timed(trained, seqs)
    split = _split_for(args, trained, seqs)
    cases = split.test if args.split == "test" else split.valid
    if args.users is not None:
        cases = subset_cases(cases, args.users, args.seed)
    results: dict[str, RankingMetrics] = {}
    extra: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    recall: dict[str, float] = {}
    leaked: float | None = None      # share of the targets the retrieval run trained on
    held: HeldOutCheck | None = None   # the same of an HSTU run's, read from its recorded data
    ranker_held: HeldOutCheck | None = None   # and of the ranking run itself
    if trained is not None:
        info = trained.run.dataset
        if (info.num_users, info.num_events) != (seqs.num_users, seqs.num_events):
            print(f"note: trained on {info.num_users} users / {info.num_events} interactions, "
                  f"evaluating on {seqs.num_users} / {seqs.num_events}")
        elif info.fingerprint not in (None, seqs.fingerprint):
            print(f"note: trained on as many users and interactions as {seqs.source} holds, "
                  "but other rows (their fingerprints differ)")
        elif info.sequence_fingerprint not in (None, seqs.sequence_fingerprint):
            print(f"note: trained on the rows {seqs.source} holds, but in a file order that "
                  "ordered some users' events otherwise (events of one timestamp keep their "
                  "file order; the sequences' fingerprints differ): its held-out items are "
                  "not the run's")
        ranker_held = check_held_out(trained, seqs, cases, parse_columns(args.columns))
        started = time.perf_counter()
        stage = stage_from_args(args, trained, seqs)
        # what the stage trained on of these targets: it decides only the stage's and the
        # cascade's figures
        if isinstance(stage, TrainedRunStage) and "cascade" in heads:
            leaked = stage.targets_trained_on(cases)
        elif isinstance(stage, HstuRunStage) and "cascade" in heads:
            held = stage.held_out(seqs, cases, parse_columns(args.columns))
        if args.fit_stage_weight and "cascade" in heads:
            fit = _fit(args, trained, seqs, CascadeSpec(stage, args.retrieve_k))
            args.stage_weight = fit.best
            extra["stage_weight_fit"] = fit.to_dict()
        cascade = CascadeSpec(stage, args.retrieve_k, args.stage_weight)
        ranks = serving_ranks(trained.model, seqs, cases, trained.model.cfg.max_seq_len,
                              trained.uses_timestamps, heads, args.batch_users,
                              progress=not args.no_progress, cascade=cascade,
                              exclude=args.exclude)
        seconds["model"] = time.perf_counter() - started
        results.update({h: RankingMetrics.from_ranks(r) for h, r in ranks.items()})
        if "cascade" in ranks:   # a proposed target ranks < K, a missed one >= K
            recall[f"recall@{args.retrieve_k}"] = float(
                (ranks["cascade"] < args.retrieve_k).double().mean())
            if len(cases) > 1:
                extra["cascade_minus_stage"] = {
                    f"{m}@10": asdict(PairedDifference.at(ranks["cascade"], ranks["stage"],
                                                          10, m)) for m in ("hr", "ndcg")}
    started = time.perf_counter()
    window = None if trained is None else trained.model.cfg.max_seq_len
    results["popularity"] = RankingMetrics.from_ranks(
        popularity_ranks(split, cases, args.exclude, window))
    seconds["popularity"] = time.perf_counter() - started
    removed = ("whole history removed" if args.exclude == "history" else
               f"the {window}-item window removed (the HSTU reference's protocol)")
    title = (f"{args.dataset} {args.split}: {len(cases)} users, {seqs.num_items} items, "
             f"{removed}")
    Console().print(_table(results, title))
    if recall:
        reads = ""
        if isinstance(stage, EmbeddingStage | TrainedRunStage):
            reads = ", " + ", ".join(f"{k.replace('_', ' ')} {v:g}"
                                     for k, v in stage.window().items())
        print(f"retrieval stage ({args.retrieval}{reads}): " +
              ", ".join(f"{k} {v:.4f}" for k, v in recall.items()))
    if leaked:
        print(f"warning: {leaked:.1%} of these targets are training interactions of the "
              "retrieval run (its split held out other events, e.g. --split cvgae's random "
              "ones): the stage's and the cascade's figures are not a clean test; evaluate "
              "with a run trained with --split disencdr (each user's last event held out)")
    if ranker_held is not None:
        _print_held_out(ranker_held, seqs.source, "ranking run (--checkpoint)", "every head's")
    if held is not None:
        _print_held_out(held, seqs.source)
    if "cascade_minus_stage" in extra:
        print("cascade - stage (paired, +- standard error): " + ", ".join(
            f"{k.upper()} {d['mean']:+.4f} +- {d['se']:.4f}"
            for k, d in extra["cascade_minus_stage"].items()))
    print("evaluation time: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = _report(args, results, seconds, len(cases), window)
        if ranker_held is not None:
            report["checkpoint_held_out"] = _held_out_fields(ranker_held)
        if recall:
            report["retrieval_stage"] = {"name": args.retrieval, "k": args.retrieve_k,
                                         "stage_weight": args.stage_weight, **recall, **extra}
            if leaked is not None:
                report["retrieval_stage"]["targets_in_run_training"] = leaked
            if held is not None:
                report["retrieval_stage"].update(_held_out_fields(held))
            if isinstance(stage, EmbeddingStage | TrainedRunStage):
                report["retrieval_stage"].update(stage.window())
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _print_held_out(held: HeldOutCheck, evaluated: str, run: str = "retrieval run",
                    figures: str = "the stage's and the cascade's") -> None:
    """Say what an HSTU run's training (the stage's, or the ranker's: ``run``) means for
    ``figures`` (``check_held_out``)."""
    if held.share is None:
        print(f"warning: the {run} was trained on {held.source}, {held.unverified}: whether it "
              f"held these targets out is unknown, so {figures} figures are not a verified "
              "clean test; evaluate where its data can be read as the run recorded it")
    elif held.share:
        print(f"warning: {held.share:.1%} of these targets are training interactions of the "
              f"{run} (trained on {held.source}, these targets from {evaluated}): {figures} "
              "figures are not a clean test; evaluate with a run trained on the evaluated "
              "data (its split holds each user's last events out)")
    elif not held.same_data:
        print(f"note: the {run} was trained on {held.source}; none of these targets is among "
              "its training interactions")


def _held_out_fields(held: HeldOutCheck) -> dict[str, Any]:
    """The report's record of ``held``: the share (null: not measured, and why), the data."""
    fields: dict[str, Any] = {"targets_in_run_training": held.share,
                              "run_data_source": held.source}
    if not held.measured:
        fields["run_data_unverified"] = held.unverified
    return fields


def _report(args: argparse.Namespace, results: dict[str, RankingMetrics],
            seconds: dict[str, float], num_cases: int, window: int | None) -> dict[str, Any]:
    return {"checkpoint": None if args.checkpoint is None else str(args.checkpoint),
            "dataset": args.dataset, "data_dir": str(args.data_dir), "split": args.split,
            "num_cases": num_cases, "users_subset": args.users, "users_seed": args.seed,
            "excluded": args.exclude, "window": window,
            "heads": {h: m.to_dict() for h, m in results.items()},
            "seconds": seconds, "machine": {"platform": platform.platform(),
                                            "torch_threads": torch.get_num_threads(),
                                            "device": args.device}}
