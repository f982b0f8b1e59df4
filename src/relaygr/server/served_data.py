"""The users a checkpoint serves from its dataset: the data its run was trained on, and no other.

A checkpoint's id map numbers the items of the data it was trained on; the same integers in
other data name other items, and the same user ids other users. The run records that data
(``train.checkpoint.DatasetInfo``: the format it was read as, the file, its users, distinct
items and events, the fingerprint of its rows and that of its users' sequences,
``relaygr.data.fingerprint``), so the served file is checked against the record, not against
the format's name: its counts, then its rows (the fingerprint), then each user's order of its
events (the sequences' fingerprint: a user's events of one timestamp keep their file order, so
the same rows in another order can give a user another history than the model was trained on).
A run saved before runs recorded a fingerprint is checked without it (by its counts alone when
it records neither). The recorded file, a copy of it elsewhere, the same rows in an order that
orders every user's events alike, or the same file read under another name of its format
(``ratings-dat`` and ``ml-1m`` both read ``ratings.dat``) serve; other data, a later export or
one of the same counts included, and the same rows ordering some user's events otherwise, are
refused at start-up with ``CatalogueMismatchError`` naming both files and the check that failed
(what arrives after training arrives through ``/v1/events`` and the event log).

The data it was trained on is then checked as training checks it (``relaygr.data.servable``):
user ids that are strings or outside 0..2^53-1 (the API's ``user_id``) are a ``ConfigError``,
and for a model that reads time a timestamp outside 0..2^40 unix seconds (the API's; one in
milliseconds) or a user whose timestamps go back in its sequence is a ``DataError`` at its
line. ``train.Trainer`` refuses such data before it trains; serving checks
again, for a checkpoint whose run did not, at start-up and before any user is built.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.cascade.window import HistoryWindow
from relaygr.errors import CatalogueMismatchError, ConfigError
from relaygr.server.config import ModelSource

if TYPE_CHECKING:
    from relaygr.data.sequences import UserSequences
    from relaygr.data.table import InteractionTable
    from relaygr.train.checkpoint import DatasetInfo


def recorded_dataset(source: ModelSource) -> ModelSource:
    """``source`` with the dataset its checkpoint's run directory records, or a ConfigError
    saying what to pass when that data is not readable here."""
    from relaygr.data import DATASET_FILES
    from relaygr.train import read_run_config

    assert source.checkpoint is not None
    info = read_run_config(source.checkpoint).dataset
    recorded = Path(info.source)
    if info.name in DATASET_FILES and recorded.exists():
        return replace(source, dataset=info.name, data_dir=recorded)
    raise ConfigError(
        f"{source.checkpoint} was trained on {info.name!r} read from {info.source}, which "
        f"is not readable here: pass --dataset {info.name} --data-dir DIR to serve its "
        f"{info.num_users} users, or --synthetic-users to serve synthetic ones")


def served_dataset(source: ModelSource) -> ModelSource | None:
    """``source`` naming the dataset whose users it serves (a checkpoint's recorded one when
    none is given, ``recorded_dataset``), or None when it serves synthetic users."""
    if source.checkpoint is not None and source.dataset is None and not source.synthetic_users:
        source = recorded_dataset(source)
    return source if source.dataset is not None and source.data_dir is not None else None


def check_served_data(source: ModelSource) -> None:
    """``CatalogueMismatchError`` unless the file ``source`` serves users from holds the data
    its checkpoint was trained on, then the checks of ``relaygr.data.servable`` on its users
    (the module docstring); nothing for synthetic users. Reads the file and orders its users'
    events (the order is part of the check), but builds no user: for a start-up that must
    refuse such data before anything slower (the Ray driver, before it starts a cluster)."""
    from relaygr.train import read_run_config

    dataset = served_dataset(source)
    if dataset is None:
        return
    assert dataset.checkpoint is not None
    _served_sequences(dataset, read_run_config(dataset.checkpoint).train.use_timestamps)


def dataset_store(source: ModelSource, window: HistoryWindow, num_items: int,
                  timed: bool) -> InMemoryHistoryStore:
    """The users of ``source.dataset`` in ``source.data_dir``, each cut to ``window``, in the
    checkpoint's item ids, timestamps kept exactly when ``timed`` (a timed model skips an
    untimed user, unless it trained such users without time, ``TrainConfig.time_where_known``:
    then they are served untimed); ``CatalogueMismatchError`` unless the file is the data the
    checkpoint was trained on, ``ConfigError`` or ``DataError`` for users it cannot serve (the
    module docstring; both checked before any user is built), ``ConfigError`` when it holds no
    user to serve."""
    from relaygr.train import read_run_config

    seqs = _served_sequences(source, timed)
    assert source.checkpoint is not None
    untimed_too = read_run_config(source.checkpoint).train.time_where_known
    users: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
    for h in seqs.histories():
        if timed and h.timestamps is None and not untimed_too:
            continue          # a timed model that never read an untimed user
        start = window.start(len(h.items))
        ts = None if not timed or h.timestamps is None else h.timestamps[start:]
        users[int(h.user_id)] = (h.items[start:], ts)    # an int: check_user_ids
    if not users:
        raise ConfigError(f"{source.dataset} in {source.data_dir} has no user this model can "
                          "serve")
    return InMemoryHistoryStore.from_sequences(users, num_items)


def _served_sequences(source: ModelSource, timed: bool) -> UserSequences:
    """The users' sequences of ``source.dataset`` in the checkpoint's item ids, once the file
    is the data it was trained on with user ids the API takes (``_checked_table``), each user's
    events in the order it was trained on (``check_trained_order``) and, when ``timed``, each
    timed user's timestamps are unix seconds the API takes, in its order (``check_times``; the
    module docstring)."""
    from relaygr.data import IdMap, build_sequences, check_times
    from relaygr.train import read_run_config
    from relaygr.train.checkpoint import ID_MAP_FILE

    assert source.checkpoint is not None
    seqs = build_sequences(_checked_table(source), IdMap.load(source.checkpoint / ID_MAP_FILE))
    check_trained_order(source.checkpoint, read_run_config(source.checkpoint).dataset, seqs)
    if timed:
        check_times(seqs)
    return seqs


def _checked_table(source: ModelSource) -> InteractionTable:
    """The table of ``source.dataset`` in ``source.data_dir``, as read, once it is checked
    against the record of the run ``source.checkpoint`` (``check_trained_data``) and its user
    ids are ones a request can name (``check_user_ids``)."""
    from relaygr.data import check_user_ids, resolve
    from relaygr.train import read_run_config

    assert source.checkpoint is not None and source.dataset is not None
    assert source.data_dir is not None
    table = resolve(source.dataset, source.data_dir).read()
    check_trained_data(source.checkpoint, read_run_config(source.checkpoint).dataset, table)
    check_user_ids(table.source, table.users)
    return table


def check_trained_data(checkpoint: Path, info: DatasetInfo, table: InteractionTable) -> None:
    """``CatalogueMismatchError`` unless ``table`` holds the data ``checkpoint`` was trained on
    (``info``, its run's record): as many users, distinct items and events, and the same rows
    when the run records their fingerprint (the module docstring)."""
    from relaygr.data import table_fingerprint

    served = (len(np.unique(table.users)), len(np.unique(table.items)), table.num_rows)
    trained = (info.num_users, info.num_items, info.num_events)
    recorded = f"{info.name!r} read from {info.source}"
    if served != trained:
        raise CatalogueMismatchError(
            f"{table.source} holds {_counts(served)}: not the data {checkpoint} was trained on "
            f"({recorded}: {_counts(trained)}), so its item ids would name other items; serve "
            "the data it was trained on, or --synthetic-users")
    if info.fingerprint is None:      # a run saved before runs recorded one: the counts alone
        return
    fingerprint = table_fingerprint(table)
    if fingerprint != info.fingerprint:
        raise CatalogueMismatchError(
            f"{table.source} holds as many users, items and events as the data {checkpoint} "
            f"was trained on ({recorded}: {_counts(trained)}), but other rows (fingerprint "
            f"{fingerprint}, the run recorded {info.fingerprint}): not the data it was trained "
            "on, so its ids would name other users and items; serve the data it was trained "
            "on, or --synthetic-users")


def check_trained_order(checkpoint: Path, info: DatasetInfo, seqs: UserSequences) -> None:
    """``CatalogueMismatchError`` unless ``seqs``, built from the rows ``checkpoint`` was
    trained on (``check_trained_data``), order each user's events as the data it was trained
    on did, when its run records their fingerprint (``info.sequence_fingerprint``; the module
    docstring): the same rows in another file order can order a user's events of one timestamp
    otherwise, a history the model never read."""
    if info.sequence_fingerprint in (None, seqs.sequence_fingerprint):
        return      # None: a run saved before runs recorded it; its rows were checked
    raise CatalogueMismatchError(
        f"{seqs.source} holds the rows {checkpoint} was trained on ({info.name!r} read from "
        f"{info.source}), but in a file order that orders its users' events otherwise (a "
        "user's events of one timestamp, or without timestamps, keep their file order; "
        f"sequence fingerprint {seqs.sequence_fingerprint}, the run recorded "
        f"{info.sequence_fingerprint}): its users' histories are not those the model was "
        "trained on; serve the file it was trained on, in its order, or --synthetic-users")


def _counts(counts: tuple[int, int, int]) -> str:
    users, items, events = counts
    return f"{users} users, {items} items, {events} events"
