"""Data where only some users are timed (the shared ML-1M table): ``time_where_known`` trains
and evaluates the untimed users without a time bias, the timed ones with it, and the dense path
computes each row as the serving passes compute that user."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.data import leave_one_out, load_sequences
from relaygr.data.sequences import UserSequences
from relaygr.errors import ConfigError, TimestampError
from relaygr.model import HSTU
from relaygr.train import TrainConfig, Trainer, load_trained
from relaygr.train.batches import TrainingData
from relaygr.train.evaluate import (
    case_windows,
    request_times,
    retrieval_ranks_padded,
    serving_ranks,
)
from tests.model.helpers import make_model
from tests.tolerance import SCORE_TOL
from tests.train.helpers import GROUPS, NUM_ITEMS, TINY

MIXED = TINY.with_(use_timestamps=True, time_where_known=True, time_query="next")


def _mixed_sequences(tmp_path: Path, num_users: int = 36) -> UserSequences:
    """The cyclic pattern of ``tests.train.helpers`` as a generic table, users above half of
    them without timestamps (empty cells)."""
    rng = np.random.default_rng(1)
    size = NUM_ITEMS // GROUPS
    rows = ["user,item,timestamp,order"]
    for user in range(1, num_users + 1):
        base, item, stamp = (user % GROUPS) * size, int(rng.integers(size)), 1_000_000
        for step in range(int(rng.integers(8, 15))):
            item = int(rng.integers(size)) if rng.random() < 0.1 else (item + 1) % size
            stamp += int(rng.integers(30, 90_000))
            rows.append(f"{user},{base + item + 1},{stamp if user <= num_users // 2 else ''},"
                        f"{step}")
    (tmp_path / "interactions.csv").write_text("\n".join(rows) + "\n")
    return load_sequences("table", tmp_path)


def test_an_untimed_row_is_computed_as_an_untimed_history() -> None:
    """A row marked untimed reads no time bias: its outputs are those of the same history given
    without timestamps, bit for bit, and a timed row's are unchanged by its neighbour's."""
    model = make_model(3, time_query="next", max_seq_len=64)
    gen = torch.Generator().manual_seed(3)
    items = torch.randint(1, 500, (2, 20), generator=gen)
    ts = 1_000_000 + torch.cumsum(torch.randint(1, 5_000, (2, 20), generator=gen), 1)
    request = ts[:, -1] + 100
    cands = torch.randint(1, 500, (2, 7), generator=gen)
    timed = torch.tensor([True, False])
    with torch.no_grad():
        mixed = model.encode_padded(items, ts, request, timed)
        assert torch.equal(mixed[1], model.encode_padded(items[1:])[0])
        assert torch.equal(mixed[0], model.encode_padded(items[:1], ts[:1], request[:1])[0])
        scores = model.rank_padded(items, cands, ts, request, timed)
        # (a batch of one computes the candidates' products in other shapes: float32 rounding)
        torch.testing.assert_close(scores[1], model.rank_padded(items[1:], cands[1:])[0],
                                   atol=SCORE_TOL, rtol=SCORE_TOL)
    with pytest.raises(TimestampError, match="bool mask"):
        model.encode_padded(items, ts, request, timed.long())
    with pytest.raises(TimestampError, match="bool mask"):
        model.encode_padded(items, None, None, timed)


def test_time_where_known_is_asked_for_and_needs_timestamps(tmp_path: Path) -> None:
    seqs = _mixed_sequences(tmp_path)
    assert 0 < seqs.timed.sum() < seqs.num_users
    with pytest.raises(ConfigError, match="time_where_known=true trains them without time"):
        Trainer(MIXED.with_(time_where_known=False), seqs, tmp_path / "refused",
                dataset="table", progress_bar=False, log=lambda _: None)
    with pytest.raises(ConfigError, match="needs use_timestamps=true"):
        TrainConfig(time_where_known=True)
    # the batches say which rows are timed; fully timed or untimed data says nothing
    data = TrainingData(leave_one_out(seqs), 24, use_timestamps=True)
    assert data.timed is not None and 0 < int(data.timed.sum()) < len(data)
    batch = data.batch(torch.arange(len(data)))
    assert batch.timed is not None and torch.equal(batch.timed, data.timed)
    assert TrainingData(leave_one_out(seqs), 24, use_timestamps=False).timed is None


def test_a_run_on_partly_timed_data_serves_each_user_as_it_evaluates_them(
        tmp_path: Path) -> None:
    seqs = _mixed_sequences(tmp_path)
    config = MIXED.with_(max_epochs=2, rank_hard_negatives=3, rank_mine_k=5,
                         rank_phase_epochs=1)
    trainer = Trainer(config, seqs, tmp_path / "run", dataset="table", progress_bar=False,
                      log=lambda _: None)
    assert trainer.fit().best_valid is not None
    model: HSTU = load_trained(tmp_path / "run").model
    test = trainer.split.test
    w = case_windows(seqs, test, np.arange(len(test)), config.max_seq_len, True)
    assert w.timed is not None
    # untimed users are queried at no time, timed ones at their held-out event's
    times = request_times(w)
    assert [t is not None for t in times] == [bool(seqs.timed[u]) for u in test.users]
    dense = retrieval_ranks_padded(model, seqs, test, config.max_seq_len, True)
    served = serving_ranks(model, seqs, test, config.max_seq_len, True,
                           heads=("retrieval", "ranking"))
    # through prefill (each user timed or not) and the dense path alike, up to a tie broken the
    # other way by float rounding
    assert (served["retrieval"] - dense).abs().max() <= 1
