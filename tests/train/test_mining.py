"""Hard negatives for the ranking head come from the retrieval head's top K, history excluded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.data import leave_one_out
from relaygr.errors import ConfigError
from relaygr.model import HSTU
from relaygr.train import TrainConfig, Trainer, load_trained
from relaygr.train.batches import TrainingData
from relaygr.train.mining import retrieval_top_k, with_hard_negatives
from relaygr.train.trainer import StageRun
from tests.train.helpers import TINY, cyclic_sequences


def _setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    seqs = cyclic_sequences(tmp_path, num_users=12)
    data = TrainingData(leave_one_out(seqs), max_seq_len=24, use_timestamps=False)
    torch.manual_seed(0)
    model = HSTU(TINY.with_(dropout=0.2).model_config(seqs.num_items))
    rank = data.rank_batch(torch.arange(12), 6, 9, torch.Generator().manual_seed(1))
    return model, rank


def test_top_k_is_the_retrieval_order_without_the_history(tmp_path: Path) -> None:
    model, rank = _setup(tmp_path)
    model.train()
    top = retrieval_top_k(model, rank.history, None, 30)
    assert model.training                                  # the mode is restored
    model.eval()
    with torch.no_grad():
        hidden = model.encode_padded(rank.history)
    for j, row in enumerate(rank.history):
        n = int((row != 0).sum())
        scores = model.retrieval_scores(hidden[j, n - 1]).detach()
        scores[0] = -np.inf
        scores[row[:n]] = -np.inf
        expected = torch.argsort(scores, descending=True, stable=True)[:30]
        assert top[j].tolist() == expected.tolist()
        assert not set(top[j].tolist()) & set(row[:n].tolist())


def test_hard_negatives_replace_the_first_uniform_ones(tmp_path: Path) -> None:
    model, rank = _setup(tmp_path)
    gen = torch.Generator().manual_seed(5)
    mined = with_hard_negatives(model, rank, 4, 30, gen)
    top = retrieval_top_k(model, rank.history, None, 30)
    assert torch.equal(mined.candidates[:, 0], rank.candidates[:, 0])        # positives kept
    assert torch.equal(mined.candidates[:, 5:], rank.candidates[:, 5:])      # uniform ones kept
    for j in range(len(top)):
        hard = mined.candidates[j, 1:5].tolist()
        assert len(set(hard)) == 4 and set(hard) <= set(top[j].tolist())   # no repeats
    assert not torch.equal(rank.candidates[:, 1:5], mined.candidates[:, 1:5])  # input unchanged
    assert with_hard_negatives(model, rank, 0, 30, gen) is rank


def test_hard_negative_settings_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rank_hard_negatives"):
        TrainConfig(rank_negatives=8, rank_hard_negatives=9)
    with pytest.raises(ConfigError, match="rank_hard_negatives"):
        TrainConfig(rank_mine_k=4, rank_hard_negatives=5)
    with pytest.raises(ConfigError, match="rank_mine_k"):
        TrainConfig(rank_mine_k=0)
    with pytest.raises(ConfigError, match="rank_score"):
        TrainConfig(rank_score="mlp")
    seqs = cyclic_sequences(tmp_path, num_users=12)     # 120 items: 200 + 24 cannot be mined
    with pytest.raises(ConfigError, match="rank_mine_k"):
        Trainer(TINY.with_(rank_hard_negatives=4), seqs, tmp_path / "run", dataset="d",
                progress_bar=False, log=lambda _: None)


def test_a_residual_run_with_hard_negatives_trains_and_serves_its_head(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=40)
    config = TINY.with_(rank_score="retrieval_residual", rank_hard_negatives=4, rank_mine_k=40,
                        rank_trains="head", similarity="cosine", temperature=0.05)
    trainer = Trainer(config, seqs, tmp_path / "run", dataset="d", seed=1, progress_bar=False,
                      log=lambda _: None)
    before = {k: v.clone() for k, v in trainer.model.rank_head.state_dict().items()}
    trainer.fit()
    assert trainer.model.cfg.rank_score == "retrieval_residual"
    after = trainer.model.rank_head.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_rank_phase_trains_the_head_alone_and_keeps_the_best_validated_cascade(
        tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=40)
    config = TINY.with_(rank_score="retrieval_residual", rank_hard_negatives=4, rank_mine_k=40,
                        rank_trains="head", similarity="cosine", temperature=0.05,
                        rank_weight=0.0)
    # seed 2: a run whose phase finds a better head than the one it started from
    plain = Trainer(config, seqs, tmp_path / "plain", dataset="d", seed=2, progress_bar=False,
                    log=lambda _: None)
    plain.fit()
    phased = Trainer(config.with_(rank_phase_epochs=4, rank_phase_users=16), seqs,
                     tmp_path / "phased", dataset="d", seed=2, progress_bar=False,
                     log=lambda _: None)
    result = phased.fit()
    assert result.progress.rank_phase_done
    before = load_trained(tmp_path / "plain").model.state_dict()
    after = load_trained(tmp_path / "phased").model.state_dict()
    head = {k for k in after if k.startswith("rank_head.")}
    # the phase starts from the schedule's best weights and moves the head only
    assert all(torch.equal(before[k], after[k]) for k in after if k not in head)
    assert any(not torch.equal(before[k], after[k]) for k in head)
    records = [json.loads(line) for line in (tmp_path / "phased" / "metrics.jsonl").open()]
    phase = [r for r in records if "rank_phase_epoch" in r]
    assert [r["rank_phase_epoch"] for r in phase] == [0, 1, 2, 3, 4]
    assert phase[0]["ranking"] is None
    # the saved head is the best validated one: re-validating it gives the best figure
    best = max(r["valid_cascade_ndcg@10"] for r in phase)
    saved = load_trained(tmp_path / "phased").model
    assert phased._validate_cascade(saved).ndcg[10] == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("timed", [False, True])
def test_a_ranker_trained_against_a_stage_mines_the_stages_top_k(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, timed: bool) -> None:
    """``--stage``: every hard negative of the schedule and of the ranking phase comes from the
    stage's retrieval head, never from the ranker's own, read as the stage serves (without time,
    a stage run being position-only, even under a timed ranker); the run records the stage."""
    seqs = cyclic_sequences(tmp_path, num_users=40)
    config = TINY.with_(rank_score="retrieval_residual", rank_hard_negatives=4, rank_mine_k=40,
                        rank_trains="head", similarity="cosine", temperature=0.05,
                        rank_phase_epochs=1, rank_phase_users=16, max_epochs=1,
                        use_timestamps=timed)
    torch.manual_seed(3)
    stage = HSTU(config.model_config(seqs.num_items)).eval()
    trainer = Trainer(config, seqs, tmp_path / "run", dataset="d", seed=1, progress_bar=False,
                      log=lambda _: None, stage=StageRun(stage, tmp_path / "stage"))
    mined_by: list[HSTU] = []

    def spy(model: HSTU, history: torch.Tensor, timestamps: torch.Tensor | None,
            k: int, query_timestamps: torch.Tensor | None = None,
            timed: torch.Tensor | None = None) -> torch.Tensor:
        mined_by.append(model)
        assert timestamps is None and query_timestamps is None and timed is None
        return retrieval_top_k(model, history, timestamps, k, query_timestamps, timed)

    monkeypatch.setattr("relaygr.train.mining.retrieval_top_k", spy)
    trainer.fit()
    assert mined_by and all(m is stage for m in mined_by)
    assert load_trained(tmp_path / "run").run.stage == str(tmp_path / "stage")
    with pytest.raises(ConfigError, match="items"):
        other = HSTU(config.model_config(seqs.num_items + 1))
        Trainer(config, seqs, tmp_path / "run2", dataset="d", progress_bar=False,
                log=lambda _: None, stage=StageRun(other, tmp_path / "stage"))
