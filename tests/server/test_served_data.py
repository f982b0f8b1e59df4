"""A checkpoint serves the users of the data it was trained on: read from the recorded file, a
copy of it, its rows in another order that orders each user's events alike, or under another
name of its format; other data in the same format is refused at start-up, since its ids would
name other users and items, even with the same counts (the run's fingerprint of its rows), and
so are its rows in a file order that orders some user's events otherwise (the fingerprint of its
sequences: events of one timestamp keep file order); a run saved before it recorded one is
checked without it. Data training refuses (user ids a request cannot name; for a model
that reads time, a timestamp a request cannot carry or a user whose time goes back in its order)
is refused at start-up too, typed and named, for a checkpoint whose run was not checked (written
here without training)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.window import HistoryWindow
from relaygr.data import load_sequences
from relaygr.errors import CatalogueMismatchError, ConfigError, DataError, InvalidInputError
from relaygr.server import ModelSource
from relaygr.server.build import load_model, load_store
from relaygr.server.schemas import EventsRequest, RecommendRequest
from relaygr.server.served_data import check_served_data
from relaygr.train import TrainConfig, Trainer
from relaygr.train.checkpoint import CONFIG_FILE
from tests.server.helpers import system_config
from tests.train.helpers import (
    BACK_POSITION,
    MS_STAMP,
    TINY,
    write_cyclic_udata,
    write_interactions,
    write_tied_udata,
    write_untrained_run,
)


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


Rows = list[list[str]]


def _rewritten(run: Path, folder: Path, change: Callable[[Rows], Rows]) -> Path:
    """``folder/ratings.dat``: the rows (fields) of the data ``run`` was trained on, changed."""
    trained = run.parent / "trained" / "ratings.dat"
    rows = [line.split("::") for line in trained.read_text().splitlines()]
    folder.mkdir()
    (folder / "ratings.dat").write_text("".join("::".join(r) + "\n" for r in change(rows)))
    return folder


def _users_swapped(rows: Rows) -> Rows:
    """Users 1 and 2 trade ids: the same users, items and events, other histories."""
    swap = {"1": "2", "2": "1"}
    return [[swap.get(r[0], r[0]), *r[1:]] for r in rows]


def _one_item_changed(rows: Rows) -> Rows:
    """One row's item changed to another the file holds, its own still held by another row:
    the same users, distinct items and events."""
    items = [r[1] for r in rows]
    row = next(i for i, item in enumerate(items) if items.count(item) > 1)
    other = next(item for item in items if item != items[row])
    return [[r[0], other, *r[2:]] if i == row else r for i, r in enumerate(rows)]


def test_the_trained_rows_in_another_order_serve(run: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    shuffled = _rewritten(run, tmp_path / "shuffled",
                          lambda rows: [rows[i] for i in rng.permutation(len(rows))])
    assert _users(ModelSource(checkpoint=run, dataset="ratings-dat", data_dir=shuffled)) == \
        _users(ModelSource(checkpoint=run))


@pytest.mark.parametrize("change", [_users_swapped, _one_item_changed])
def test_other_rows_of_the_same_counts_are_refused(run: Path, tmp_path: Path,
                                                   change: Callable[[Rows], Rows]) -> None:
    other = _rewritten(run, tmp_path / "other", change)
    with pytest.raises(CatalogueMismatchError, match=r"as many users, items and events .* but "
                       r"other rows \(fingerprint [0-9a-f]{32}, the run recorded") as refused:
        _users(ModelSource(checkpoint=run, dataset="ratings-dat", data_dir=other))
    assert str(other / "ratings.dat") in str(refused.value)
    assert str(run.parent / "trained" / "ratings.dat") in str(refused.value)


def test_a_run_without_a_fingerprint_is_checked_by_its_counts(run: Path, tmp_path: Path) -> None:
    old = tmp_path / "old-run"
    shutil.copytree(run, old)
    config = json.loads((old / CONFIG_FILE).read_text())
    for recorded in ("fingerprint", "sequence_fingerprint"):   # as saved before runs did
        del config["dataset"][recorded]
    (old / CONFIG_FILE).write_text(json.dumps(config))
    swapped = _rewritten(run, tmp_path / "swapped", _users_swapped)
    served = _users(ModelSource(checkpoint=old, dataset="ratings-dat", data_dir=swapped))
    assert served[1] == _users(ModelSource(checkpoint=run))[2]      # the counts cannot tell
    with pytest.raises(CatalogueMismatchError, match=r"not the data .* was trained on"):
        _users(ModelSource(checkpoint=old, dataset="ratings-dat",
                           data_dir=_ratings_dat(tmp_path / "other", seed=1)))


def test_the_trained_rows_ordering_users_otherwise_are_refused(tmp_path: Path) -> None:
    """Each user's last two events tie on their timestamp, so their file order is their order
    in the user's history: the same rows with each tied pair in the other order are the same
    table and other histories, which the model was not trained on."""
    trained = write_tied_udata(tmp_path / "trained" / "u.data", num_users=24)
    run = write_untrained_run(tmp_path / "run", load_sequences("ml-100k", trained))
    recorded = _users(ModelSource(checkpoint=run))
    swapped = write_tied_udata(tmp_path / "swapped" / "u.data", num_users=24, swapped=True)
    source = ModelSource(checkpoint=run, dataset="ml-100k", data_dir=swapped.parent)
    for start_up in (_users, check_served_data):
        with pytest.raises(CatalogueMismatchError, match=r"holds the rows .* was trained on .* "
                           r"but in a file order that orders its users' events otherwise .*"
                           r"sequence fingerprint [0-9a-f]{32}, the run recorded") as refused:
            start_up(source)
        assert str(swapped) in str(refused.value) and str(trained) in str(refused.value)
    # a run saved before runs recorded its sequences is checked by its rows alone: it serves
    # them, in the file's order (other histories; nothing can tell)
    old = tmp_path / "old-run"
    shutil.copytree(run, old)
    config = json.loads((old / CONFIG_FILE).read_text())
    del config["dataset"]["sequence_fingerprint"]
    (old / CONFIG_FILE).write_text(json.dumps(config))
    check_served_data(ModelSource(checkpoint=old, dataset="ml-100k", data_dir=swapped.parent))
    served = _users(ModelSource(checkpoint=old, dataset="ml-100k", data_dir=swapped.parent))
    assert served.keys() == recorded.keys() and served != recorded
    assert all(served[u][:-2] == recorded[u][:-2] and served[u][-2:] == recorded[u][:-3:-1]
               for u in served)


def _unchecked_run(tmp_path: Path, users: Sequence[object], config: TrainConfig = TINY,
                   back: object = None, milliseconds: object = None) -> ModelSource:
    """A checkpoint recording a generic table of ``users`` (``write_interactions``) as its
    training data, written without the checks training makes."""
    data = write_interactions(tmp_path / "data" / "interactions.csv", users, back=back,
                              milliseconds=milliseconds)
    run = write_untrained_run(tmp_path / "run", load_sequences("table", data), config,
                              dataset="table")
    return ModelSource(checkpoint=run)


@pytest.mark.parametrize(("users", "refusal"), [
    ([f"user-{u}" for u in range(1, 25)],
     r"names its users by strings \(24 of its 24 user ids are not integers, the first "
     r"'user-1'\)"),
    ([2 ** 60 + u for u in range(24)],
     rf"has user ids outside 0\.\.2\^53-1 \(24 of its 24 users, the first {2 ** 60}\)"),
])
def test_user_ids_a_request_cannot_name_are_refused_at_start_up(
        tmp_path: Path, users: list[object], refusal: str) -> None:
    source = _unchecked_run(tmp_path, users)
    data = tmp_path / "data" / "interactions.csv"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(data))} {refusal}: "):
        _users(source)
    with pytest.raises(ConfigError, match=refusal):     # the Ray driver's check, before a cluster
        check_served_data(source)


def test_a_timed_users_time_going_back_is_refused_at_start_up_naming_it(tmp_path: Path) -> None:
    users = list(range(1, 25))
    source = _unchecked_run(tmp_path / "timed", users, TINY.with_(use_timestamps=True), back=7)
    data = tmp_path / "timed" / "data" / "interactions.csv"
    line = 2 + 6 * 10 + BACK_POSITION
    for start_up in (_users, check_served_data):
        with pytest.raises(DataError, match=rf"^{re.escape(str(data))}:{line}: user 7's event at "
                           rf"position {BACK_POSITION} \(0-based\) of its sequence"):
            start_up(source)
    # a model without time never reads them: user 7 serves, in the order column's order
    untimed = _unchecked_run(tmp_path / "untimed", users, back=7)
    served = _users(untimed)
    assert len(served) == 24 and served[7] == [(6 * 7 + step) % 40 + 1 for step in range(10)]


def test_a_timed_users_timestamps_in_milliseconds_are_refused_at_start_up(
        tmp_path: Path) -> None:
    """Past 2^40 s no ``/v1/events`` could follow them (a request's timestamp would be before
    the user's latest): refused before any user is built, at the first such line."""
    users = list(range(1, 25))
    source = _unchecked_run(tmp_path / "timed", users, TINY.with_(use_timestamps=True),
                            milliseconds=9)
    data = tmp_path / "timed" / "data" / "interactions.csv"
    line = 2 + 8 * 10
    for start_up in (_users, check_served_data):
        with pytest.raises(DataError, match=rf"^{re.escape(str(data))}:{line}: user 9 has "
                           rf"timestamp {MS_STAMP}, outside the 0\.\.2\^40 unix seconds a "
                           r"request can carry \(10 of the 240 events of timed users\): .*"
                           "most likely milliseconds"):
            start_up(source)
    # a model without time never reads them: user 9 serves, untimed
    untimed = _unchecked_run(tmp_path / "untimed", users, milliseconds=9)
    assert len(_users(untimed)) == 24


def test_the_timestamp_bound_is_the_apis_and_every_stores() -> None:
    """One bound, unix seconds in 0..2^40: a store holds no event whose user ``/v1/events``
    could no longer extend, and refuses what the API refuses."""
    for request, field in ((EventsRequest, "timestamps"), (RecommendRequest, "recent_timestamps")):
        schema = request.model_json_schema()["properties"][field]["anyOf"][0]["items"]
        assert (schema["minimum"], schema["maximum"]) == (0, 2 ** 40)
    store = InMemoryHistoryStore(num_items=5)
    store.append(1, [1, 2], [0, 2 ** 40])
    for stamp in (2 ** 40 + 1, MS_STAMP, -1):
        with pytest.raises(InvalidInputError, match=r"unix seconds in \[0, 2\^40\]"):
            store.append(2, [1], [stamp])
    assert list(store) == [1]


def test_the_user_id_bound_is_the_apis_and_every_stores() -> None:
    """One bound, 2^53-1 (what JSON carries exactly): a store holds no user that neither
    ``/v1/recommend`` nor ``/v1/events`` could name."""
    largest = 2 ** 53 - 1
    for request in (RecommendRequest, EventsRequest):
        assert request.model_json_schema()["properties"]["user_id"]["maximum"] == largest
    store = InMemoryHistoryStore(num_items=5)
    store.append(largest, [1])
    with pytest.raises(InvalidInputError, match=r"\[0, 2\^53-1\]"):
        store.append(largest + 1, [1])
    assert list(store) == [largest]
