"""The model options a run trains with: ``layer_style`` set from the command line's overrides,
recorded in the run, reloaded and served by every path; ``time_query="next"`` trained with the
targets' times as the queries' (the ranking head's candidates at the positive's), evaluated
densely and through the model's serving passes alike, and loaded by the relay's server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.cli.train import parse_overrides
from relaygr.data import leave_one_out
from relaygr.errors import ConfigError
from relaygr.model import HSTU, RankInput
from relaygr.server.build import load_model
from relaygr.server.config import ModelSource
from relaygr.train import (
    TrainConfig,
    Trainer,
    load_trained,
    read_run_config,
    retrieval_ranks_padded,
    serving_ranks,
)
from relaygr.train.batches import TrainingData
from relaygr.train.evaluate import case_windows, request_times
from tests.train.helpers import TINY, cyclic_sequences


def test_a_reference_style_run_trains_records_reloads_and_serves(tmp_path: Path) -> None:
    config = TINY.with_(**parse_overrides(["layer_style=reference", "max_epochs=1"]))
    assert config.model_config(10).layer_style == "reference"
    seqs = cyclic_sequences(tmp_path, num_users=24)
    trainer = Trainer(config, seqs, tmp_path / "run", dataset="ml-100k", progress_bar=False,
                      log=lambda _: None)
    trainer.fit()
    assert read_run_config(tmp_path / "run").model.layer_style == "reference"
    trained = load_trained(tmp_path / "run")
    assert trained.run.train == config and trained.model.cfg == trainer.model.cfg
    assert trained.model.blocks[0].f1.bias is None
    served = load_model(ModelSource(checkpoint=tmp_path / "run"))
    for (name, a), (_, b) in zip(trainer.model.state_dict().items(),
                                 served.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    _assert_serving_paths_agree(served, seqs.sequence(0), seqs.num_items)
    # the retrieval head through prefill (serving) and encode_padded (validation) agree
    ranks = serving_ranks(served, seqs, trainer.split.test, config.max_seq_len, False,
                          heads=("retrieval",))
    padded = retrieval_ranks_padded(served, seqs, trainer.split.test, config.max_seq_len, False)
    assert (padded - ranks["retrieval"]).abs().max() <= 1


def _assert_serving_paths_agree(model: HSTU, sequence: object, num_items: int) -> None:
    """Cached ranking equals the full pass, and a prefill's last state equals the dense
    path's, on one real history."""
    items = torch.as_tensor(sequence)[:12]
    candidates = torch.arange(1, num_items + 1)
    kv = model.prefill(items[:8])
    cached = model.rank_batch([RankInput(candidates, prefix=kv, suffix_items=items[8:])])[0]
    full = model.rank(candidates, prefix_items=items[:8], suffix_items=items[8:])
    torch.testing.assert_close(cached, full)
    with torch.no_grad():
        hidden = model.encode_padded(items[None])[0, -1]
    torch.testing.assert_close(model.prefill(items).last_hidden, hidden)


def test_a_bad_layer_style_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="layer_style must be one of"):
        TrainConfig(layer_style="meta")


NEXT = TINY.with_(use_timestamps=True, time_query="next")


def test_next_needs_timestamps() -> None:
    assert NEXT.model_config(10).time_query == "next" and TINY.time_query == "own"
    with pytest.raises(ConfigError, match="needs use_timestamps=true"):
        TINY.with_(time_query="next")
    with pytest.raises(ConfigError, match="time_query must be one of"):
        NEXT.with_(time_query="previous")


def test_training_queries_at_the_targets_times_and_evaluation_at_the_held_out_items(
        tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=20)
    split = leave_one_out(seqs)
    data = TrainingData(split, max_seq_len=6, use_timestamps=True)
    assert data.timestamps is not None
    users = np.flatnonzero(split.train_lengths >= 2)
    for row, user in enumerate(users):
        n = int(data.lengths[row])
        end = seqs.offsets[user] + split.train_lengths[user]
        assert data.timestamps[row, :n].tolist() == seqs.timestamps[end - n - 1:end - 1].tolist()
    # a batch is queried at the time after each window: its last target's
    batch = data.batch(torch.arange(4))
    assert batch.query_timestamps is not None and batch.query_timestamps.shape == (4,)
    for row in range(4):
        end = seqs.offsets[users[row]] + split.train_lengths[users[row]]
        assert int(batch.query_timestamps[row]) == int(seqs.timestamps[end - 1])
    assert TrainingData(split, 6, False).batch(torch.arange(4)).query_timestamps is None
    # the ranking head: the positive at the cut, its time the request's
    rank = data.rank_batch(torch.arange(len(users)), 8, 3, torch.Generator().manual_seed(0))
    assert rank.query_timestamps is not None and rank.timestamps is not None
    for j in range(len(rank.history)):
        cut = int((rank.history[j] != 0).sum())
        same = ((data.inputs[:, :cut] == rank.history[j, :cut]).all(1)
                & (data.timestamps[:, :cut] == rank.timestamps[j, :cut]).all(1)
                & (data.targets[:, cut - 1] == rank.candidates[j, 0]))
        row = int(torch.nonzero(same)[0])
        end = seqs.offsets[users[row]] + split.train_lengths[users[row]]
        positive = end - int(data.lengths[row]) + cut - 1          # targets[row, cut - 1]
        assert int(rank.query_timestamps[j]) == int(seqs.timestamps[positive])
    # an "own" model's ranking examples are at their positives' times too (serving's request
    # time); untimed data has none
    own_rank = TrainingData(split, 6, True).rank_batch(torch.arange(4), 2, 3,
                                                       torch.Generator().manual_seed(0))
    assert own_rank.query_timestamps is not None and own_rank.query_timestamps.shape == (2,)
    assert TrainingData(split, 6, False).rank_batch(
        torch.arange(4), 2, 3, torch.Generator().manual_seed(0)).query_timestamps is None
    # evaluation: each case queried at its held-out event's time (the request's)
    cases = split.test
    rows = np.arange(len(cases))
    w = case_windows(seqs, cases, rows, 6, True)
    assert w.timestamps is not None and w.request_timestamps is not None
    assert case_windows(seqs, cases, rows, 6, False).request_timestamps is None
    for j, (user, length) in enumerate(zip(cases.users, cases.history_lengths, strict=True)):
        assert int(w.request_timestamps[j]) == seqs.timestamps[seqs.offsets[user] + length]
        assert int(w.targets[j]) == seqs.items[seqs.offsets[user] + length]


def test_a_next_run_trains_both_heads_serves_them_exactly_and_loads_for_the_relay(
        tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=24)
    config = NEXT.with_(max_epochs=1, rank_score="retrieval_residual", rank_hard_negatives=3,
                        rank_mine_k=5, rank_phase_epochs=1)
    trainer = Trainer(config, seqs, tmp_path / "run", dataset="ml-100k", progress_bar=False,
                      log=lambda _: None)
    result = trainer.fit()
    assert result.best_valid is not None
    assert result.best_valid.num_cases == len(trainer.split.valid)
    trained = load_trained(tmp_path / "run")
    assert trained.model.cfg.time_query == "next" and trained.uses_timestamps
    test = trainer.split.test
    ranks = retrieval_ranks_padded(trained.model, seqs, test, config.max_seq_len, True)
    assert len(ranks) == len(test) and (ranks >= 0).all()
    # through prefill and the cached pass (the prefix computed for the held-out item's time):
    # the dense path's ranks, up to a tie broken the other way by float rounding
    served = serving_ranks(trained.model, seqs, test, config.max_seq_len, True,
                           heads=("retrieval", "ranking", "cascade"))
    assert (served["retrieval"] - ranks).abs().max() <= 1
    assert len(served["ranking"]) == len(served["cascade"]) == len(test)
    # the same weights read at their own times rank otherwise: the request time is used
    own = HSTU(trained.model.cfg.with_(time_query="own")).eval()
    own.load_state_dict(trained.model.state_dict())
    own_ranks = retrieval_ranks_padded(own, seqs, test, config.max_seq_len, True)
    assert not torch.equal(ranks, own_ranks)
    served_model = load_model(ModelSource(checkpoint=tmp_path / "run"))   # what serve loads
    assert served_model.cfg.next_time_query


def test_evaluation_ranks_at_the_held_out_events_time(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranking head and the cascade score candidates at the request time, as serving does:
    in evaluation the held-out event's timestamp, for any timed model."""
    seqs = cyclic_sequences(tmp_path, num_users=12)
    test = leave_one_out(seqs).test
    model = HSTU(TINY.with_(use_timestamps=True).model_config(seqs.num_items)).eval()
    held_out = [int(seqs.timestamps[seqs.offsets[u] + n])
                for u, n in zip(test.users, test.history_lengths, strict=True)]
    w = case_windows(seqs, test, np.arange(len(test)), TINY.max_seq_len, True)
    assert request_times(w) == held_out
    seen: list[int | None] = []
    rank_batch = model.rank_batch

    def recording(requests: list[RankInput]) -> list[torch.Tensor]:
        seen.extend(r.query_timestamp for r in requests)
        return rank_batch(requests)

    monkeypatch.setattr(model, "rank_batch", recording)
    serving_ranks(model, seqs, test, TINY.max_seq_len, True, heads=("ranking", "cascade"),
                  batch_users=len(test))
    assert seen == held_out + held_out          # the ranking head, then the cascade's ranker
