"""``serve --ray``'s driver settles what it deploys in the embedded server's order before any
cluster starts: the model, the retrieval run, the served data against the run's record, and only
then the users (to size the budgets). Other data, or a run that does not fit, is refused before
a user is built and before a cluster starts (no Ray cluster is started here: one would be a
failure)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

from relaygr.cli import serve
from relaygr.data import UserEvents, UserSequences, load_sequences
from relaygr.distributed import app
from relaygr.errors import CatalogueMismatchError, ConfigError
from relaygr.train import Trainer
from tests.train.helpers import TINY, write_cyclic_udata

GIVEN_BUDGETS = '{"instance": {"device_budget_bytes": 67108864, "host_budget_bytes": 134217728}}'


class ClusterStarted(Exception):
    """The driver went on to start (or join) a Ray cluster."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained on ``trained/u.data`` read as ``ml-100k``."""
    root = tmp_path_factory.mktemp("ray-start")
    (root / "trained").mkdir()
    data = write_cyclic_udata(root / "trained" / "u.data", num_users=24, seed=0)
    Trainer(TINY.with_(max_epochs=1), load_sequences("ml-100k", data), root / "run",
            dataset="ml-100k", progress_bar=False, log=lambda _: None).fit()
    return root / "run"


@pytest.fixture
def users_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files whose users the server builds (``UserSequences.histories``, which
    ``server.served_data`` reads each user from; the check orders the users' events, but builds
    none), in order; a cluster start raises ``ClusterStarted``."""
    read: list[str] = []
    histories = UserSequences.histories

    def spy(seqs: UserSequences) -> Iterator[UserEvents]:
        read.append(seqs.source)
        return histories(seqs)

    def start(*args: Any, **kwargs: Any) -> None:
        raise ClusterStarted

    monkeypatch.setattr(UserSequences, "histories", spy)
    monkeypatch.setattr(app, "init_ray", start)
    return read


def _serve_ray(run: Path, data: Path, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return app.serve_forever(serve.options_from_args(parser.parse_args([
        "serve", "--ray", "--replicas", "1", "--checkpoint", str(run), "--events", "none",
        "--dataset", "ml-100k", "--data-dir", str(data), *argv])))


@pytest.fixture(params=["sized", "given"])
def budgets(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, ...]:
    """The budgets sized from the users (the driver reads them), or given (it does not)."""
    if request.param == "sized":
        return ()
    path = tmp_path / "system.json"
    path.write_text(GIVEN_BUDGETS)
    return ("--system-config", str(path))


def test_other_data_is_refused_before_any_user_is_built_or_a_cluster_starts(
        run: Path, tmp_path: Path, users_read: list[str], budgets: tuple[str, ...]) -> None:
    (tmp_path / "other").mkdir()
    write_cyclic_udata(tmp_path / "other" / "u.data", num_users=24, seed=1)
    with pytest.raises(CatalogueMismatchError, match=r"not the data .* was trained on"):
        _serve_ray(run, tmp_path / "other", *budgets)
    assert users_read == []


def test_a_retrieval_run_that_does_not_fit_is_refused_before_the_users(
        run: Path, tmp_path: Path, users_read: list[str], budgets: tuple[str, ...]) -> None:
    (tmp_path / "not-a-run").mkdir()
    with pytest.raises(ConfigError, match="neither an HSTU training run"):
        _serve_ray(run, run.parent / "trained", "--retrieval-run", str(tmp_path / "not-a-run"),
                   *budgets)
    assert users_read == []


def test_the_trained_data_is_checked_then_its_users_read_before_the_cluster_starts(
        run: Path, users_read: list[str], budgets: tuple[str, ...]) -> None:
    with pytest.raises(ClusterStarted):
        _serve_ray(run, run.parent / "trained", *budgets)
    # the users are read for the budgets when they are sized, not otherwise
    assert users_read == ([str(run.parent / "trained" / "u.data")] if not budgets else [])


def test_the_driver_loads_the_model_once(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model settles the system, the retrieval check and the application from one load
    (a large checkpoint read three times delayed every start)."""
    loads: list[Any] = []
    load = app.load_model

    def counted(*args: Any, **kwargs: Any) -> Any:
        loads.append(args)
        return load(*args, **kwargs)

    def bound(application: Any, **kwargs: Any) -> None:
        assert application is not None
        raise ClusterStarted

    monkeypatch.setattr(app, "load_model", counted)
    monkeypatch.setattr(app, "init_ray", lambda *args, **kwargs: None)
    monkeypatch.setattr(app.ray, "cluster_resources", lambda: {"CPU": 4.0})
    monkeypatch.setattr(app.serve, "start", lambda *args, **kwargs: None)
    monkeypatch.setattr(app.serve, "run", bound)
    with pytest.raises(ClusterStarted):
        _serve_ray(run, run.parent / "trained")
    assert len(loads) == 1
