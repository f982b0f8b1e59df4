"""What a recommendation may not contain: the whole history (serving) or the model's window (the
HSTU reference's protocol), against ranks counted by hand."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.cli import eval as eval_cli
from relaygr.data import leave_one_out
from relaygr.errors import ConfigError
from relaygr.model import HSTU, PrefillInput
from relaygr.train import popularity_ranks, retrieval_ranks_padded, serving_ranks
from relaygr.train.evaluate import EXCLUSIONS
from tests.train.helpers import TINY, cyclic_sequences, write_untrained_run

# Shorter than every generated history (8-14 events, the last two held out), so that each user
# has items outside the window.
WINDOW = 4


def _by_hand(scores: torch.Tensor, target: int, excluded: np.ndarray, tol: float = 0.0
             ) -> range:
    """The ranks the target may have: items other than it, padding and ``excluded`` scoring at
    least its score, counted with the scores ``tol`` higher and lower (``tol``: what another
    batching of the same float32 pass may move a score by)."""
    others = [item for item in range(1, len(scores)) if item != target and item not in excluded]
    low = sum(1 for item in others if scores[item] - tol >= scores[target])
    high = sum(1 for item in others if scores[item] + tol >= scores[target])
    return range(low, high + 1)


def test_the_window_removes_only_what_the_model_reads(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=24)
    cases = leave_one_out(seqs).test
    torch.manual_seed(0)
    model = HSTU(TINY.with_(max_seq_len=WINDOW).model_config(seqs.num_items)).eval()
    ranks = {e: serving_ranks(model, seqs, cases, WINDOW, False, ("retrieval", "ranking"),
                              exclude=e) for e in EXCLUSIONS}
    with torch.inference_mode():
        for j, (user, n, target) in enumerate(zip(cases.users, cases.history_lengths,
                                                  cases.targets, strict=True)):
            history = seqs.sequence(user)[:n]
            assert len(history) > WINDOW
            window = history[-WINDOW:]
            # one user alone, where the evaluation prefilled eight together
            [kv] = model.prefill_batch([PrefillInput(torch.from_numpy(window))])
            scores = model.retrieval_scores(kv.last_hidden[None])[0].float()
            # float32 over reductions of dim 16: a few ulps of the largest score
            tol = 1e-5 * float(scores[1:].abs().max())
            assert ranks["history"]["retrieval"][j] in _by_hand(scores, int(target), history, tol)
            assert ranks["window"]["retrieval"][j] in _by_hand(scores, int(target), window, tol)
    for head in ("retrieval", "ranking"):
        # removing more items that are not the target can only raise it
        assert (ranks["history"][head] <= ranks["window"][head]).all()
    assert (ranks["history"]["retrieval"] < ranks["window"]["retrieval"]).any()
    padded = retrieval_ranks_padded(model, seqs, cases, WINDOW, False, exclude="window")
    assert (padded - ranks["window"]["retrieval"]).abs().max() <= 1   # float32 near-ties


def test_popularity_removes_the_window_it_is_compared_under(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=24)
    split = leave_one_out(seqs)
    counts = np.bincount(np.concatenate([seqs.sequence(u)[:n] for u, n in
                                         enumerate(split.train_lengths)]),
                         minlength=seqs.num_items + 1)
    scores = torch.from_numpy(counts.astype(np.float32))
    window = popularity_ranks(split, split.test, "window", WINDOW)
    whole = popularity_ranks(split, split.test)
    for j, (user, n, target) in enumerate(zip(split.test.users, split.test.history_lengths,
                                              split.test.targets, strict=True)):
        history = seqs.sequence(user)[:n]
        assert window[j] in _by_hand(scores, int(target), history[-WINDOW:])
        assert whole[j] in _by_hand(scores, int(target), history)
    with pytest.raises(ConfigError, match="needs the window's length"):
        popularity_ranks(split, split.test, "window")


def test_the_cascade_and_unknown_exclusions_are_refused(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=8)
    cases = leave_one_out(seqs).test
    model = HSTU(TINY.model_config(seqs.num_items)).eval()
    with pytest.raises(ConfigError, match="cascade removes the whole history"):
        serving_ranks(model, seqs, cases, TINY.max_seq_len, False, ("cascade",),
                      exclude="window")
    with pytest.raises(ConfigError, match="exclude must be one of"):
        serving_ranks(model, seqs, cases, TINY.max_seq_len, False, ("retrieval",),
                      exclude="seen")


def _eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="relaygr")
    eval_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", *argv])
    return int(args.func(args))


def test_eval_reports_what_it_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=24)
    run = write_untrained_run(tmp_path / "run", seqs, TINY.with_(max_seq_len=WINDOW))
    data = ["--dataset", "ml-100k", "--data-dir", str(tmp_path), "--no-progress"]
    reports = {}
    for exclude in EXCLUSIONS:
        out = tmp_path / f"{exclude}.json"
        assert _eval(["--checkpoint", str(run), *data, "--exclude", exclude,
                      "--json", str(out)]) == 0
        reports[exclude] = json.loads(out.read_text())
    assert "the 4-item window removed" in capsys.readouterr().out
    window, whole = reports["window"], reports["history"]
    assert (window["excluded"], window["window"]) == ("window", WINDOW)
    assert whole["excluded"] == "history"
    assert set(window["heads"]) == {"retrieval", "ranking", "popularity"}
    assert {"cascade", "stage"} <= set(whole["heads"])
    for head in ("retrieval", "ranking", "popularity"):
        assert window["heads"][head]["mrr"] <= whole["heads"][head]["mrr"]
    with pytest.raises(ConfigError, match="without --exclude window"):
        _eval(["--checkpoint", str(run), *data, "--exclude", "window", "--heads",
               "retrieval,cascade"])
    with pytest.raises(ConfigError, match="give --checkpoint"):
        _eval([*data, "--exclude", "window"])
