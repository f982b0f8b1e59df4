"""``relaygr eval --retrieval`` with the stages ``relaygr serve`` serves, offline: a trained
retrieval run (``relaygr train-retrieval``, ``serve --retrieval-run``) and serve's default, the
ranker's own item embeddings (``--retrieval item-embeddings``)."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.cascade.item_cf import ItemCFRetrieval
from relaygr.cascade.proposals import EmbeddingRetrieval, InterleavedRetrieval
from relaygr.cascade.trained_retrieval import TrainedRetrieval
from relaygr.cli import eval as eval_cli
from relaygr.cli.eval_stages import (
    RECENCY,
    RECENT_EVENTS,
    RUN_SHARE,
    EmbeddingStage,
    TrainedRunStage,
    stage_from_args,
)
from relaygr.cli.main import main
from relaygr.data import leave_one_out, load_sequences
from relaygr.errors import ConfigError
from relaygr.retrieval.checkpoint import load_catalogue, load_seed, read_run_info
from relaygr.train import load_trained
from relaygr.train.stages import RetrievalQuery
from tests.cascade.retrieval_runs import BruteForce, brute_force, train_run, write_ratings
from tests.cli.test_train_eval import TINY_SETTINGS
from tests.tolerance import reorder_tolerance
from tests.train.helpers import write_untrained_run


def _eval_stage(argv: list[str], ranker: Path, data: Path) -> object:
    """The stage ``relaygr eval`` builds from ``argv`` (its ``--retrieval...`` options)."""
    parser = argparse.ArgumentParser(prog="relaygr")
    eval_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", "--checkpoint", str(ranker), "--dataset", "ml-1m",
                              "--data-dir", str(data), *argv])
    trained = load_trained(ranker, "cpu")
    return stage_from_args(args, trained, load_sequences("ml-1m", data, None, trained.id_map))


def test_eval_gives_both_served_stages_the_window_and_recency_it_is_asked_for(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_ratings(data)
    retrieval = train_run(data, tmp_path / "sage")
    ranker = _train_ranker(data, tmp_path / "hstu")
    for name in ("item-embeddings", str(retrieval)):
        for argv, want in (([], (RECENT_EVENTS, RECENCY)),
                           (["--retrieval-history", "8", "--retrieval-recency", "0.6"], (8, 0.6))):
            stage = _eval_stage(["--retrieval", name, *argv], ranker, data)
            assert isinstance(stage, EmbeddingStage | TrainedRunStage)
            window = stage.window()
            assert (window["history"], window["recency"]) == want
            if isinstance(stage, TrainedRunStage):   # beside item-embeddings, as serve serves
                assert window["run_share"] == RUN_SHARE
                assert isinstance(stage.stage, InterleavedRetrieval)
                default, run, item_cf = stage.stage.channels
                assert run is stage.run and isinstance(default, EmbeddingRetrieval)
                assert isinstance(item_cf, ItemCFRetrieval)
                assert (default.recent_events, default.recency) == want
                assert (item_cf.recent_events, item_cf.recency) == want
    alone = _eval_stage(["--retrieval", str(retrieval), "--retrieval-run-share", "1"], ranker,
                        data)
    assert isinstance(alone, TrainedRunStage) and alone.stage is alone.run
    assert (alone.window()["run_share"], alone.window()["item_cf_share"]) == (1.0, 0.0)
    three = _eval_stage(["--retrieval", str(retrieval), "--retrieval-run-share", "0.4",
                         "--retrieval-item-cf-rest-share", "0.5"], ranker, data)
    assert isinstance(three, TrainedRunStage) and isinstance(three.stage, InterleavedRetrieval)
    assert [type(c) for c in three.stage.channels] == [EmbeddingRetrieval, TrainedRetrieval,
                                                       ItemCFRetrieval]
    assert (three.window()["run_share"], three.window()["item_cf_share"]) \
        == pytest.approx((0.4, 0.3))
    two = _eval_stage(["--retrieval", str(retrieval), "--retrieval-item-cf-rest-share", "0"],
                      ranker, data)
    assert isinstance(two, TrainedRunStage) and isinstance(two.stage, InterleavedRetrieval)
    assert [type(c) for c in two.stage.channels] == [EmbeddingRetrieval, TrainedRetrieval]
    # an HSTU head reads the whole history, alone: a window or share asked of it is refused
    for head in ("head", str(ranker)):
        for option in ("--retrieval-recency", "--retrieval-run-share",
                       "--retrieval-item-cf-rest-share"):
            with pytest.raises(ConfigError, match="an HSTU head reads the whole history"):
                _eval_stage(["--retrieval", head, option, "0.5"], ranker, data)
    with pytest.raises(ConfigError, match="leaves no share to --retrieval-item-cf-rest-share"):
        _eval_stage(["--retrieval", str(retrieval), "--retrieval-run-share", "1",
                     "--retrieval-item-cf-rest-share", "0.5"], ranker, data)
    with pytest.raises(ConfigError, match=r"--retrieval-item-cf-rest-share must be in \[0, 1\]"):
        _eval_stage(["--retrieval", str(retrieval), "--retrieval-item-cf-rest-share", "nan"],
                    ranker, data)
    for option in ("--retrieval-run-share", "--retrieval-item-cf-rest-share"):
        with pytest.raises(ConfigError, match="is not a run"):
            _eval_stage(["--retrieval", "item-embeddings", option, "0.5"], ranker, data)
    with pytest.raises(ConfigError, match=r"\(--retrieval-run-share 1\)"):
        _eval_stage(["--retrieval", str(retrieval), "--stage-weight", "0.5"], ranker, data)


def _train_ranker(data: Path, out: Path) -> Path:
    settings = [arg for s in TINY_SETTINGS for arg in ("--set", s)]
    assert main(["train", "--dataset", "ml-1m", "--data-dir", str(data), "--out", str(out),
                 "--preset", "quick", "--no-progress", *settings]) == 0
    return out


def test_a_retrieval_run_proposes_its_exact_top_k_and_the_ranker_orders_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    write_ratings(data)
    retrieval = train_run(data, tmp_path / "sage")
    ranker = _train_ranker(data, tmp_path / "hstu")
    seqs = load_sequences("ml-1m", data)
    model = load_trained(ranker, "cpu").model
    stage = TrainedRunStage.load(retrieval, seqs, "ml-1m", model, share=1.0)   # the run alone
    cases = leave_one_out(seqs).test
    histories = [seqs.sequence(u)[:n] for u, n in zip(cases.users[:3], cases.history_lengths[:3],
                                                      strict=True)]
    k = 20
    proposals = stage.propose(RetrievalQuery(cases.users[:3], histories, []), k)
    for j, history in enumerate(histories):
        exact = brute_force(retrieval, np.asarray(seqs.id_map.items), history,
                            int(seqs.user_ids[cases.users[j]]), RECENT_EVENTS, RECENCY)
        unseen = ~np.isin(exact.ids, history)        # the offline cascade removes the history
        ids, _ = proposals.row(j)
        expected = type(exact)(exact.ids[unseen], exact.scores[unseen], exact.tol)
        expected.check(ids.numpy(), k)
    report = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-1m", "--data-dir",
                 str(data), "--retrieval", str(retrieval), "--retrieve-k", str(k),
                 "--heads", "cascade", "--no-progress", "--json", str(report)]) == 0
    heads = json.loads(report.read_text())["heads"]
    reported = json.loads(report.read_text())["retrieval_stage"]
    recall = reported[f"recall@{k}"]
    assert (reported["history"], reported["recency"], reported["run_share"]) == (
        RECENT_EVENTS, RECENCY, RUN_SHARE)                  # serve's stage: beside the default
    assert {"cascade", "stage"} <= set(heads)
    # the ranker reorders the stage's proposals: neither finds a target the stage missed
    assert heads["stage"]["hr@10"] <= recall and heads["cascade"]["hr@10"] <= recall
    # the run's cvgae split held out a random event, so most of these last events are its own
    # training interactions: measured, said, and recorded, as are the ones it did not train on
    info = read_run_info(retrieval)
    rows = load_seed(retrieval, info, info.seeds[0]).splits[info.domains[0]].train
    catalogue = load_catalogue(retrieval, info)
    run_items = catalogue.items[info.domains[0]]
    trained = {(int(catalogue.users[u]), int(run_items[i])) for u, i in rows.tolist()}
    targets = [(int(seqs.user_ids[u]), int(seqs.id_map.items[t - 1]))
               for u, t in zip(cases.users, cases.targets, strict=True)]
    share = sum(pair in trained for pair in targets) / len(targets)
    assert 0 < share < 1 and reported["targets_in_run_training"] == pytest.approx(share)
    assert f"warning: {share:.1%} of these targets are training interactions" in \
        capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-1m", "--data-dir",
                 str(data), "--retrieval", str(retrieval), "--fit-stage-weight",
                 "--no-progress"]) == 2
    assert "needs an HSTU run as the stage" in capsys.readouterr().err


def test_serves_default_stage_proposes_the_exact_top_k_of_the_mean_of_recent_embeddings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    write_ratings(data)
    ranker = _train_ranker(data, tmp_path / "hstu")
    seqs = load_sequences("ml-1m", data)
    recent, recency = 8, 0.6        # a window shorter than the histories, so it matters
    model = load_trained(ranker, "cpu").model
    stage = EmbeddingStage(EmbeddingRetrieval.of(model, recent, recency=recency))
    cases = leave_one_out(seqs).test
    histories = [seqs.sequence(u)[:n] for u, n in zip(cases.users[:4], cases.history_lengths[:4],
                                                      strict=True)]
    assert min(len(h) for h in histories) > recent
    # the user: the normalised mean of its latest events' embeddings, the k-th newest weighing
    # recency ** k; the items: the model's retrieval vectors (row i is id i + 1), what the FAISS
    # index holds
    raw = model.item_emb.weight.detach().double()
    vectors = torch.cat([torch.zeros(1, raw.shape[1]), model.item_embeddings().detach()]).double()
    k = 50
    proposals = stage.propose(RetrievalQuery(cases.users[:4], histories, []), k)
    for j, history in enumerate(histories):
        weights = torch.tensor([recency ** age for age in range(recent - 1, -1, -1)],
                               dtype=torch.float64)
        user = (weights[:, None] * raw[history[-recent:]]).sum(0)
        user = user / user.norm()
        scores = (vectors @ user).numpy()
        unseen = np.setdiff1d(np.arange(1, len(vectors)), history)   # id 0 pads, never an item
        order = unseen[np.argsort(-scores[unseen], kind="stable")]
        terms = float((vectors.abs() @ user.abs()).max())
        # the user vector's own float32 sums (the window's, its norm) and the scores' dot
        # products: two chained reductions
        exact = BruteForce(order, scores[order],
                           reorder_tolerance(vectors.shape[1], terms, chained=2))
        ids, _ = proposals.row(j)
        exact.check(ids.numpy(), k)
    # a catalogue too small for k unseen items is proposed whole, padded past its end
    whole = stage.propose(RetrievalQuery(cases.users[:1], histories[:1], []), 10_000)
    assert len(whole.row(0)[0]) == seqs.num_items - len(np.unique(histories[0]))
    report = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-1m", "--data-dir",
                 str(data), "--retrieval", "item-embeddings", "--retrieve-k", str(k),
                 "--retrieval-history", str(recent), "--retrieval-recency", str(recency),
                 "--heads", "cascade", "--no-progress", "--json", str(report)]) == 0
    written = json.loads(report.read_text())["retrieval_stage"]
    assert (written["name"], written["history"], written["recency"]) == \
        ("item-embeddings", recent, recency)
    # the eval's recall is this stage's over every user
    every = [seqs.sequence(u)[:n] for u, n in zip(cases.users, cases.history_lengths,
                                                  strict=True)]
    found = stage.propose(RetrievalQuery(cases.users, every, []), k)
    hits = [t in found.row(j)[0].tolist() for j, t in enumerate(cases.targets.tolist())]
    assert written[f"recall@{k}"] == pytest.approx(np.mean(hits), abs=1e-12)
    heads = json.loads(report.read_text())["heads"]
    assert heads["cascade"]["hr@10"] <= written[f"recall@{k}"]
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-1m", "--data-dir",
                 str(data), "--retrieval", "item-embeddings", "--retrieval-history", "0",
                 "--no-progress"]) == 2
    assert "--retrieval-history must be >= 1" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-1m", "--data-dir",
                 str(data), "--retrieval", "item-embeddings", "--retrieval-recency", "1.5",
                 "--no-progress"]) == 2
    assert "--retrieval-recency in (0, 1]" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-1m", "--data-dir",
                 str(data), "--retrieval", "item-embeddings", "--fit-stage-weight",
                 "--no-progress"]) == 2
    assert "needs an HSTU run as the stage" in capsys.readouterr().err


def test_a_retrieval_run_is_refused_data_whose_user_ids_serving_could_not_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run looks each user up by its integer id, as serve does: string ids (data evaluated
    against an integer-id run) are a ConfigError naming the file and the first, as training's
    and serve's (data.servable), not a bare ValueError mid-evaluation; and the ranking run's
    own held-out check takes them (none is one of its users), not a bare TypeError."""
    data = tmp_path / "data"
    write_ratings(data)
    retrieval = train_run(data, tmp_path / "sage")
    ranker = write_untrained_run(tmp_path / "hstu", load_sequences("ml-1m", data),
                                 dataset="ml-1m")
    with gzip.open(data / "ratings_ordered.csv.gz", "rt") as fh:
        rows = fh.read().splitlines()
    named = tmp_path / "named" / "interactions.csv"
    named.parent.mkdir()
    named.write_text("\n".join([rows[0], *(f"u{row}" for row in rows[1:])]) + "\n")
    columns = "user=user_id,item=movie_id,timestamp=timestamp,order=seq_pos"
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "table", "--data-dir",
                 str(named), "--columns", columns, "--retrieval", str(retrieval), "--heads",
                 "cascade", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith(
        f"relaygr eval: error: {named} names its users by strings (40 of its 40 user ids are "
        "not integers, the first 'u1'): ")
    # the ranker alone reads no user id: the same data evaluates, none of its users the run's
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "table", "--data-dir",
                 str(named), "--columns", columns, "--heads", "cascade", "--no-progress"]) == 0
    assert "none of these targets is among its training interactions" in capsys.readouterr().out
