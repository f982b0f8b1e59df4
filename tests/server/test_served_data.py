"""A checkpoint serves the users of the data it was trained on: read from the recorded file, a
copy of it, or under another name of its format; other data in the same format is refused at
start-up, since its item ids would name other items."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from relaygr.cascade.window import HistoryWindow
from relaygr.data import load_sequences
from relaygr.errors import CatalogueMismatchError
from relaygr.server import ModelSource
from relaygr.server.build import load_model, load_store
from relaygr.train import Trainer
from tests.server.helpers import system_config
from tests.train.helpers import TINY, write_cyclic_udata


def _ratings_dat(folder: Path, seed: int) -> Path:
    """``folder/ratings.dat`` (GroupLens ``::`` fields) of the cyclic log of ``seed``."""
    folder.mkdir(parents=True, exist_ok=True)
    udata = write_cyclic_udata(folder / "u.data", num_users=24, seed=seed)
    lines = ["::".join(line.split("\t")) for line in udata.read_text().splitlines()]
    udata.unlink()
    (folder / "ratings.dat").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained on ``ratings.dat`` read as ``ratings-dat``."""
    root = tmp_path_factory.mktemp("served-data")
    data = _ratings_dat(root / "trained", seed=0)
    Trainer(TINY.with_(max_epochs=1), load_sequences("ratings-dat", data), root / "run",
            dataset="ratings-dat", progress_bar=False, log=lambda _: None).fit()
    return root / "run"


def _users(source: ModelSource) -> dict[int, list[int]]:
    model = load_model(source)
    store = load_store(source, model, HistoryWindow.for_model(model.cfg, system_config()))
    return {user: store.get(user).items.tolist() for user in store}


def test_the_trained_data_serves_from_a_copy_and_under_another_name(run: Path,
                                                                     tmp_path: Path) -> None:
    recorded = _users(ModelSource(checkpoint=run))
    copy = tmp_path / "copy"
    shutil.copytree(run.parent / "trained", copy)
    assert _users(ModelSource(checkpoint=run, dataset="ratings-dat", data_dir=copy)) == recorded
    # ml-1m reads the same ratings.dat: the same data, whatever the format is called
    assert _users(ModelSource(checkpoint=run, dataset="ml-1m", data_dir=copy)) == recorded


def test_other_data_of_the_same_format_is_refused(run: Path, tmp_path: Path) -> None:
    other = _ratings_dat(tmp_path / "other", seed=1)      # the same items, other events
    with pytest.raises(CatalogueMismatchError, match=r"not the data .* was trained on"):
        _users(ModelSource(checkpoint=run, dataset="ratings-dat", data_dir=other))
