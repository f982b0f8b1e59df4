"""``relaygr eval --retrieval RUN`` with a trained retrieval run (``relaygr train-retrieval``) as
the cascade's retrieval stage: the stage ``serve --retrieval-run`` serves, offline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from relaygr.cli.eval_stages import RECENT_EVENTS, TrainedRunStage
from relaygr.cli.main import main
from relaygr.data import leave_one_out, load_sequences
from relaygr.train.stages import RetrievalQuery
from tests.cascade.retrieval_runs import brute_force, train_run, write_ratings
from tests.cli.test_train_eval import TINY_SETTINGS


def test_a_retrieval_run_proposes_its_exact_top_k_and_the_ranker_orders_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    write_ratings(data)
    retrieval = train_run(data, tmp_path / "sage")
    ranker = tmp_path / "hstu"
    settings = [arg for s in TINY_SETTINGS for arg in ("--set", s)]
    assert main(["train", "--dataset", "ml-1m", "--data-dir", str(data), "--out", str(ranker),
                 "--preset", "quick", "--no-progress", *settings]) == 0
    seqs = load_sequences("ml-1m", data)
    stage = TrainedRunStage.load(retrieval, seqs, "ml-1m")
    cases = leave_one_out(seqs).test
    histories = [seqs.sequence(u)[:n] for u, n in zip(cases.users[:3], cases.history_lengths[:3],
                                                      strict=True)]
    k = 20
    proposals = stage.propose(RetrievalQuery(cases.users[:3], histories, []), k)
    for j, history in enumerate(histories):
        exact = brute_force(retrieval, np.asarray(seqs.id_map.items), history,
                            int(seqs.user_ids[cases.users[j]]), RECENT_EVENTS)
        unseen = ~np.isin(exact.ids, history)        # the offline cascade removes the history
        ids, _ = proposals.row(j)
        expected = type(exact)(exact.ids[unseen], exact.scores[unseen], exact.tol)
        expected.check(ids.numpy(), k)
    report = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-1m", "--data-dir",
                 str(data), "--retrieval", str(retrieval), "--retrieve-k", str(k),
                 "--heads", "cascade", "--no-progress", "--json", str(report)]) == 0
    heads = json.loads(report.read_text())["heads"]
    recall = json.loads(report.read_text())["retrieval_stage"][f"recall@{k}"]
    assert {"cascade", "stage"} <= set(heads)
    # the ranker reorders the stage's proposals: neither finds a target the stage missed
    assert heads["stage"]["hr@10"] <= recall and heads["cascade"]["hr@10"] <= recall
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ranker), "--dataset", "ml-1m", "--data-dir",
                 str(data), "--retrieval", str(retrieval), "--fit-stage-weight",
                 "--no-progress"]) == 2
    assert "needs an HSTU run as the stage" in capsys.readouterr().err
