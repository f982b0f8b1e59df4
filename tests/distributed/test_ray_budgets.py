"""``serve --ray`` sizes each ranking replica's cache budgets as the embedded server sizes its
instances' (from the model and the users), for the replicas it starts; given budgets win."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("ray")

from relaygr.cascade.window import HistoryWindow
from relaygr.cli import serve
from relaygr.distributed.app import ray_budgets
from relaygr.kvcache import KVLayout
from relaygr.kvcache.sizing import available_host_bytes, size_budgets
from relaygr.server.build import load_model, load_store
from relaygr.server.config import ServeOptions


def _options(*argv: str) -> ServeOptions:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return serve.options_from_args(parser.parse_args([
        "serve", "--ray", "--replicas", "3", "--size", "tiny", "--num-items", "500",
        "--max-seq-len", "256", "--num-users", "20", "--max-events", "200", *argv]))


def test_replica_budgets_are_sized_from_the_model_and_users_for_the_replicas() -> None:
    options = _options()
    heard: list[str] = []
    model = load_model(options.model)
    system = ray_budgets(options, model, heard.append)
    users = load_store(options.model, model, HistoryWindow.for_model(model.cfg, options.system))
    want = size_budgets(KVLayout.for_model(model.cfg, model.dtype),
                        [users.num_events(u) for u in users], model.cfg.max_seq_len,
                        options.system.instance.page_tokens, 3, available_host_bytes())
    assert system.instance.device_budget_bytes == want.device_bytes
    # the cap is a share of the memory available now: equal unless it binds (it does not here)
    assert not want.capped and system.instance.host_budget_bytes == want.host_bytes
    assert system.num_instances == options.system.num_instances     # only the budgets change
    assert heard == [want.describe()]


def test_given_budgets_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "system.json"
    path.write_text(json.dumps({"instance": {"device_budget_bytes": 1 << 26,
                                             "host_budget_bytes": 1 << 27}}))
    heard: list[str] = []
    options = _options("--system-config", str(path))
    system = ray_budgets(options, load_model(options.model), heard.append)
    assert (system.instance.device_budget_bytes, system.instance.host_budget_bytes) == \
        (1 << 26, 1 << 27)
    assert heard == []
