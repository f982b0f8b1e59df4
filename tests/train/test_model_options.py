"""The model options a run trains with (``TrainConfig.layer_style``): set from the command
line's overrides, recorded in the run, reloaded, and served by every path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relaygr.cli.train import parse_overrides
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
