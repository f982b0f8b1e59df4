"""A tiny run on generated data learns, and its heads agree between the training and serving
paths; batching and the losses do exactly what their docstrings say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.window import HistoryWindow
from relaygr.data import iter_histories, leave_one_out, load_sequences
from relaygr.errors import CatalogueMismatchError, CheckpointError, ConfigError, DataError
from relaygr.model import HSTU
from relaygr.server.build import load_model, load_store
from relaygr.server.config import ModelSource
from relaygr.train import (
    PRESETS,
    RankingMetrics,
    TrainConfig,
    Trainer,
    TrainProgress,
    load_trained,
    losses,
    popularity_ranks,
    retrieval_ranks_padded,
    serving_ranks,
)
from relaygr.train.batches import LengthBucketOrder, RandomOrder, TrainingData
from relaygr.train.losses import ranking_loss, retrieval_loss
from tests.tolerance import SCORE_TOL, reorder_tolerance, stored_rounding_tolerance
from tests.train.helpers import (
    BACK_POSITION,
    MS_STAMP,
    NUM_ITEMS,
    TINY,
    cyclic_sequences,
    write_cyclic_udata,
    write_interactions,
)


def test_presets_are_valid_and_follow_the_paper() -> None:
    paper = PRESETS["paper"]
    assert (paper.dim, paper.num_layers, paper.num_heads) == (50, 2, 1)
    assert (paper.batch_size, paper.max_seq_len) == (128, 200)
    reference = PRESETS["reference"]
    assert (reference.num_negatives, reference.learning_rate, reference.max_epochs) == \
        (128, 1e-3, 101)
    assert (paper.similarity, paper.temperature, paper.dropout) == ("cosine", 0.05, 0.2)
    # every preset builds the reference's layers (docs/training.md: +0.012-0.016 HR@10)
    assert {cfg.layer_style for cfg in PRESETS.values()} == {"reference"}
    assert paper.model_config(10).layer_style == "reference"
    large = PRESETS["paper-large"]
    assert (large.num_layers, large.num_heads, large.model_config(10).head_dim) == (8, 2, 25)
    with pytest.raises(ConfigError, match="unknown TrainConfig keys"):
        TrainConfig.from_dict({"dim": 8, "colour": 1})
    with pytest.raises(ConfigError, match="divisible"):
        TrainConfig(dim=50, num_heads=3)
    # the ML-1M presets train the ranking head as the cascade's second stage
    for name in ("paper", "quick"):
        cfg = PRESETS[name]
        assert (cfg.rank_score, cfg.rank_hard_negatives, cfg.rank_mine_k, cfg.rank_phase_epochs) \
            == ("retrieval_residual", 48, 200, 3)
        assert cfg.model_config(10).rank_score == "retrieval_residual"


def test_training_windows_and_batch_orders_are_exact(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=20)
    split = leave_one_out(seqs)
    data = TrainingData(split, max_seq_len=6, use_timestamps=False)
    for row in range(len(data)):
        train = seqs.sequence(row)[:split.train_lengths[row]][-7:]
        n = int(data.lengths[row])
        assert n == len(train) - 1
        assert data.inputs[row, :n].tolist() == train[:-1].tolist()
        assert data.targets[row, :n].tolist() == train[1:].tolist()
        assert not data.inputs[row, n:].any() and not data.targets[row, n:].any()
    gen = torch.Generator().manual_seed(0)
    for order in (RandomOrder(), LengthBucketOrder()):
        batches = data.epoch(order, 3, gen)
        assert sorted(torch.cat(batches).tolist()) == list(range(len(data)))
    rank = data.rank_batch(torch.arange(len(data)), 5, 4, gen)
    assert rank.candidates.shape == (5, 5)
    for j in range(5):
        cut = int((rank.history[j] != 0).sum())
        rows = [r for r in range(len(data)) if data.inputs[r, :cut].tolist() ==
                rank.history[j, :cut].tolist()
                and data.targets[r, cut - 1] == rank.candidates[j, 0]]
        assert rows, "each ranking example is a prefix of a training row and its next item"


def test_retrieval_loss_matches_a_direct_computation(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=8)
    data = TrainingData(leave_one_out(seqs), max_seq_len=24, use_timestamps=False)
    torch.manual_seed(0)
    model = HSTU(TINY.model_config(seqs.num_items)).eval()
    batch = data.batch(torch.arange(4))
    loss = retrieval_loss(model, batch, 5, "sequence", torch.Generator().manual_seed(3))
    negs = torch.randint(1, seqs.num_items + 1, (4, 5), generator=torch.Generator().manual_seed(3))
    hidden = model.encode_padded(batch.inputs)
    terms = []
    for b in range(4):
        for t in range(int(data.lengths[b])):
            scores = model.retrieval_scores(hidden[b, t])
            target = int(batch.targets[b, t])
            logits = [scores[target]] + [scores[n] if n != target else torch.tensor(-5e4)
                                         for n in negs[b].tolist()]
            terms.append(-torch.log_softmax(torch.stack(logits), 0)[0])
    # float32: a mean over the positions of a 6-way log-softmax each, in other orders
    tol = reorder_tolerance(terms=len(terms), abs_sum=loss.item(), chained=2)
    torch.testing.assert_close(loss, torch.stack(terms).mean(), rtol=0.0, atol=tol)


def test_catalogue_softmax_in_blocks_equals_the_whole_softmax(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    # An identity of the algorithm (blocks of positions sum to the whole), checked in float64:
    # rounding then sits near 1e-12 (tolerance below), while a dropped, doubled or misweighted
    # position moves the loss and the gradient by ~1e-3. In float32 the blocked sums differ
    # from the whole by machine-dependent rounding (AVX2 vs AVX-512), not by the algorithm.
    seqs = cyclic_sequences(tmp_path, num_users=8)
    data = TrainingData(leave_one_out(seqs), max_seq_len=24, use_timestamps=False)
    torch.manual_seed(0)
    model = HSTU(TINY.model_config(seqs.num_items)).eval().double()
    batch = data.batch(torch.arange(4))
    gen = torch.Generator().manual_seed(0)
    hidden = model.encode_padded(batch.inputs)
    valid = batch.targets != 0
    whole = torch.nn.functional.cross_entropy(
        torch.stack([model.retrieval_scores(h) for h in hidden[valid]])[:, 1:],
        batch.targets[valid] - 1)
    positions = int(valid.sum())
    # the positions' terms (losses of order 1, gradients far below) summed in another order,
    # after a softmax over the catalogue
    tol = reorder_tolerance(positions * seqs.num_items, abs_sum=whole.item() * positions,
                            dtype=torch.float64, chained=2)
    grads = []
    for block_bytes in (1 << 30, 3 * 8 * seqs.num_items):     # one block; blocks of 3 positions
        monkeypatch.setattr(losses, "_CATALOGUE_BLOCK_BYTES", block_bytes)
        model.zero_grad()
        loss = retrieval_loss(model, batch, 1, "catalogue", gen)
        torch.testing.assert_close(loss, whole, rtol=0.0, atol=tol)
        loss.backward()
        assert model.item_emb.weight.grad is not None
        grads.append(model.item_emb.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0.0, atol=tol)


@pytest.mark.parametrize("sharing", ["position", "sequence", "catalogue"])
def test_retrieval_loss_denominator_reweights_the_same_sum(tmp_path: Path, sharing: str) -> None:
    """loss_mean="epoch" divides the batch's summed loss by a fixed count instead of its own
    number of positions: the same terms, so loss x denominator is the batch's sum either way."""
    seqs = cyclic_sequences(tmp_path, num_users=8)
    data = TrainingData(leave_one_out(seqs), max_seq_len=24, use_timestamps=False)
    torch.manual_seed(0)
    model = HSTU(TINY.model_config(seqs.num_items)).eval()
    batch = data.batch(torch.arange(4))
    positions = int((batch.targets != 0).sum())
    mean = retrieval_loss(model, batch, 5, sharing, torch.Generator().manual_seed(3))
    fixed = retrieval_loss(model, batch, 5, sharing, torch.Generator().manual_seed(3), 37.5)
    # the same float32 sum, then divided and multiplied back: four roundings of its size
    tol = stored_rounding_tolerance(roundings=4, magnitude=(mean * positions).item(),
                                    dtype=torch.float32)
    torch.testing.assert_close(fixed * 37.5, mean * positions, rtol=0.0, atol=tol)


def test_epoch_loss_mean_trains_and_bad_training_options_are_config_errors(
        tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=16)
    cfg = TINY.with_(loss_mean="epoch", final_norm=False, adam_beta2=0.98, max_epochs=2)
    trainer = Trainer(cfg, seqs, tmp_path / "run", dataset="cyclic", progress_bar=False,
                      log=lambda _: None)
    assert isinstance(trainer.model.final_norm, torch.nn.Identity)
    assert trainer.optimizer.defaults["betas"] == (0.9, 0.98)
    first = trainer.train_epoch(TrainProgress())
    second = trainer.train_epoch(TrainProgress())
    assert second["retrieval"] < first["retrieval"]
    for bad in ({"loss_mean": "user"}, {"adam_beta2": 1.0}, {"final_norm": "maybe"}):
        with pytest.raises(ConfigError):
            TINY.with_(**bad)


def test_head_only_ranking_loss_trains_the_head_alone_on_the_same_scores(
        tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=8)
    data = TrainingData(leave_one_out(seqs), max_seq_len=24, use_timestamps=False)
    torch.manual_seed(0)
    model = HSTU(TINY.model_config(seqs.num_items))
    rank = data.rank_batch(torch.arange(8), 4, 5, torch.Generator().manual_seed(1))
    joint = ranking_loss(model.eval(), rank)
    head = ranking_loss(model, rank, head_only=True)
    # the same function, fewer gradients: the candidate states come from the same layers by
    # another pass (SCORE_TOL's reordered attention), the loss is of order 1
    torch.testing.assert_close(head, joint, rtol=SCORE_TOL, atol=SCORE_TOL)
    model.zero_grad(set_to_none=True)
    head.backward()
    trained = {name for name, p in model.named_parameters() if p.grad is not None}
    assert trained == {name for name, _ in model.rank_head.named_parameters(prefix="rank_head")}


def test_tiny_run_lowers_loss_and_beats_random_and_popularity(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path)
    # ~1900 ranking examples: about what the ranking head needs to leave chance on this data
    config = TINY.with_(max_epochs=20, batch_size=32, rank_users=32)
    trainer = Trainer(config, seqs, tmp_path / "run", dataset="ml-100k", seed=1,
                      progress_bar=False, log=lambda _: None)
    result = trainer.fit()
    history = result.progress.history
    assert len(history) == 20 and result.progress.stopped.startswith("reached max_epochs")
    assert history[-1]["retrieval"] < 0.6 * history[0]["retrieval"]
    assert history[-1]["ranking"] < history[0]["ranking"]
    # random recommendation finds the target in the top 10 of ~110 unseen items ~9% of the time
    random_hr10 = 10 / (NUM_ITEMS - 10)
    trained = load_trained(tmp_path / "run")
    split = trainer.split
    ranks = serving_ranks(trained.model, seqs, split.test, config.max_seq_len, False)
    retrieval = RankingMetrics.from_ranks(ranks["retrieval"])
    ranking = RankingMetrics.from_ranks(ranks["ranking"])
    popularity = RankingMetrics.from_ranks(popularity_ranks(split, split.test))
    assert retrieval.hr[10] > 4 * random_hr10 and retrieval.hr[10] > 2 * popularity.hr[10]
    assert ranking.hr[10] > 2 * random_hr10 and ranking.hr[10] > popularity.hr[10]
    # the serving path (prefill + last_hidden) and the training path (encode_padded) agree
    padded = retrieval_ranks_padded(trained.model, seqs, split.test, config.max_seq_len, False)
    assert (padded - ranks["retrieval"]).abs().max() <= 1
    # batches are formed by length; ranks still come back in case order
    small = retrieval_ranks_padded(trained.model, seqs, split.test, config.max_seq_len, False,
                                   batch_size=7)
    assert (small - padded).abs().max() <= 1


def test_saved_model_loads_to_the_same_function(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=16)
    trainer = Trainer(TINY.with_(max_epochs=1), seqs, tmp_path / "run", dataset="d",
                      progress_bar=False, log=lambda _: None)
    trainer.fit()
    trained = load_trained(tmp_path / "run")
    assert trained.id_map == seqs.id_map and not trained.uses_timestamps
    assert trained.run.model == trainer.model.cfg and trained.run.train == TINY.with_(max_epochs=1)
    for (name, a), (_, b) in zip(trainer.model.state_dict().items(),
                                 trained.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    known = list(seqs.id_map.items[:2])
    assert trained.dense_items(known).tolist() == [1, 2]
    # what `relaygr serve --checkpoint` loads: the same weights, in eval mode
    served = load_model(ModelSource(checkpoint=tmp_path / "run"))
    assert not served.training
    for (name, a), (_, b) in zip(trainer.model.state_dict().items(),
                                 served.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointError, match="not in this model's id map"):
        trained.dense_items([10_000])
    (tmp_path / "run" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_trained(tmp_path / "run")
    with pytest.raises(CheckpointError, match="not a training run"):
        load_trained(tmp_path)


def test_valid_users_trains_the_other_users_validation_items(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=32)
    trainer = Trainer(TINY.with_(valid_users=8), seqs, tmp_path / "run", dataset="d",
                      progress_bar=False)
    assert len(trainer.split.valid) == 8
    held = set(trainer.split.valid.users.tolist())
    full = leave_one_out(seqs)
    for user in range(len(seqs.lengths)):
        extra = 0 if user in held else 1
        assert trainer.split.train_lengths[user] == full.train_lengths[user] + extra
    assert trainer.data.lengths.sum() == (trainer.split.train_lengths - 1).sum()
    everyone = Trainer(TINY.with_(valid_users=10_000), seqs, tmp_path / "run2", dataset="d",
                       progress_bar=False)   # more than are evaluated: the classic split
    assert everyone.split.train_lengths.tolist() == full.train_lengths.tolist()


def test_training_refuses_data_its_checkpoint_could_not_serve(tmp_path: Path) -> None:
    """A checkpoint serves the users of the data it was trained on, so user ids a request
    cannot name, and for a model that reads time a timestamp a request cannot carry or a user
    whose time goes back in its order, are refused before anything is trained or written (the
    same checks as serve's, data.servable).
    """
    def trainer(users: list[object], config: TrainConfig = TINY, back: object = None,
                milliseconds: object = None) -> Trainer:
        path = write_interactions(tmp_path / "data" / "interactions.csv", users, back=back,
                                  milliseconds=milliseconds)
        return Trainer(config, load_sequences("table", path), tmp_path / "run",
                       dataset="table", progress_bar=False, log=lambda _: None)

    with pytest.raises(ConfigError, match=r"names its users by strings \(24 of its 24 user ids "
                       r"are not integers, the first 'user-1'\)"):
        trainer([f"user-{u}" for u in range(1, 25)])
    with pytest.raises(ConfigError, match=r"outside 0\.\.2\^53-1 \(24 of its 24 users, the "
                       rf"first {2 ** 53}\)"):
        trainer([2 ** 53 + u for u in range(24)])
    line = 2 + 6 * 10 + BACK_POSITION                      # user 7 is the 7th of 24
    with pytest.raises(DataError, match=rf"interactions\.csv:{line}: user 7's event at position "
                       rf"{BACK_POSITION} \(0-based\)") as refused:
        trainer(list(range(1, 25)), TINY.with_(use_timestamps=True), back=7)
    assert refused.value.line == line and not (tmp_path / "run").exists()
    # a timestamp a request cannot carry (past 2^40 s: milliseconds), at the first such line
    line = 2 + 8 * 10
    with pytest.raises(DataError, match=rf"interactions\.csv:{line}: user 9 has timestamp "
                       rf"{MS_STAMP}, outside the 0\.\.2\^40 unix seconds .* most likely "
                       "milliseconds") as refused:
        trainer(list(range(1, 25)), TINY.with_(use_timestamps=True), milliseconds=9)
    assert refused.value.line == line and not (tmp_path / "run").exists()
    # the same data trains position-only: its timestamps are never read
    assert trainer(list(range(1, 25)), back=7).seqs.num_users == 24
    assert trainer(list(range(1, 25)), milliseconds=9).seqs.num_users == 24
    # the largest id a request can name trains
    assert trainer([2 ** 53 - 24 + u for u in range(24)]).seqs.num_users == 24


def test_a_checkpoint_serves_its_datasets_users_untimed_and_within_length(tmp_path: Path) -> None:
    udata = write_cyclic_udata(tmp_path / "u.data", num_users=16)   # timed events
    raw = [int(line.split()[1]) for line in udata.read_text().splitlines()]
    with udata.open("a") as out:          # user 17: a history longer than the window
        out.write("".join(f"17\t{raw[k % len(raw)]}\t5\t{1000 + k}\n" for k in range(61)))
    seqs = load_sequences("ml-100k", udata)
    Trainer(TINY.with_(max_epochs=1), seqs, tmp_path / "run", dataset="ml-100k",
            progress_bar=False, log=lambda _: None).fit()
    source = ModelSource(checkpoint=tmp_path / "run", dataset="ml-100k", data_dir=tmp_path)
    model = load_model(source)
    window = HistoryWindow.for_model(model.cfg, SystemConfig())
    store = load_store(source, model, window)
    for user in iter_histories("ml-100k", tmp_path, id_map=seqs.id_map):
        served = store.get(int(user.user_id))
        assert served.timestamps is None                     # the run trained position-only
        start = window.start(len(user.items))                # its newest window (slides later)
        assert served.items.tolist() == user.items[start:].tolist()
    # without --dataset: the users of the data the run directory records, the same users
    recorded = load_store(ModelSource(checkpoint=tmp_path / "run"), model, window)
    assert sorted(recorded) == sorted(store) and len(store) == 17
    synthetic = load_store(ModelSource(checkpoint=tmp_path / "run", num_users=3,
                                       synthetic_users=True), model, window)
    assert all(synthetic.get(u).timestamps is None
               and len(synthetic.get(u).items) <= model.cfg.max_seq_len for u in (1, 2, 3))
    # a history longer than the window: its newest window, cut on a block boundary
    [whole] = [h for h in iter_histories("ml-100k", tmp_path, id_map=seqs.id_map)
               if h.user_id == 17]
    assert len(whole.items) == 61 and (window.max_tokens, window.slide_tokens) == (24, 3)
    assert store.get(17).items.tolist() == whole.items[39:].tolist()  # ceil((61 - 24) / 3) * 3
    with pytest.raises(ConfigError, match="needs --checkpoint"):
        ModelSource(dataset="ml-100k", data_dir=tmp_path)
    # other data: its item ids would name other items, refused (not by the format's name)
    other = tmp_path / "other"
    other.mkdir()
    (other / "u.data").write_text("".join(udata.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(CatalogueMismatchError, match="not the data"):
        load_store(ModelSource(checkpoint=tmp_path / "run", dataset="ml-100k", data_dir=other),
                   model, window)
    # the recorded data gone: a refusal that says what to pass, never synthetic users
    (tmp_path / "u.data").rename(tmp_path / "moved.data")
    with pytest.raises(ConfigError, match="pass --dataset ml-100k --data-dir DIR"):
        load_store(ModelSource(checkpoint=tmp_path / "run"), model, window)


def test_runs_of_different_seeds_hold_out_the_same_validation_users(tmp_path: Path) -> None:
    seqs = cyclic_sequences(tmp_path, num_users=32)
    runs = [Trainer(TINY.with_(valid_users=8), seqs, tmp_path / f"run{seed}", dataset="d",
                    seed=seed, progress_bar=False) for seed in (0, 1)]
    assert runs[0].split.valid.users.tolist() == runs[1].split.valid.users.tolist()
    other = Trainer(TINY.with_(valid_users=8, valid_seed=5), seqs, tmp_path / "run5",
                    dataset="d", progress_bar=False)
    assert other.split.valid.users.tolist() != runs[0].split.valid.users.tolist()
