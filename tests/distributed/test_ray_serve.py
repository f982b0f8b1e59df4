"""On a real local Ray cluster: 2 ranking replicas behind Serve, relaygr's router inside Serve.

Asserted from the replicas' own records (``LegLedger``), not from the router's belief: both legs
of every non-spilled request ran on one replica; killing a replica under load loses no request
(the ingress answers from the user's next choice) and its users move.
"""

from __future__ import annotations

import socket
import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from relaygr.cascade.window import HistoryWindow
from relaygr.distributed.ledger import LegRecord, read_ledger
from relaygr.server import ServerConfig
from relaygr.server.build import load_model, load_store
from tests.engine.helpers import flops_cost_model
from tests.server.helpers import SOURCE, system_config
from tests.tolerance import SCORE_TOL

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@dataclass
class Cluster:
    url: str
    ledger: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.serve.config import HTTPOptions

    from relaygr.distributed.app import RayAppSpec, build_application, init_ray

    ledger = tmp_path_factory.mktemp("ledger")
    init_ray(num_cpus=2)
    port = _free_port()
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
        model = load_model(SOURCE)
        spec = RayAppSpec(SOURCE, system_config(stages={"retrieval_delay_ms": 5,
                                                          "preprocess_delay_ms": 5}),
                          ServerConfig(), replicas=2, replica_cpus=0.5, ingress_cpus=0.5,
                          cost_model=flops_cost_model(model.cfg).to_dict(), ledger_dir=ledger,
                          torch_threads=1)
        serve.run(build_application(spec), name="relaygr", route_prefix="/")
        yield Cluster(f"http://127.0.0.1:{port}", ledger)
    finally:
        serve.shutdown()
        ray.shutdown()


def _check_scores(responses: list[httpx.Response]) -> None:
    model = load_model(SOURCE)
    window = HistoryWindow.for_model(model.cfg, system_config())
    store = load_store(SOURCE, model, window)   # the ingress's store (no events appended here)
    for r in responses:
        assert r.status_code == 200, r.text
        out = r.json()
        h = store.get(out["user_id"])
        want = model.rank(torch.tensor(out["candidates"]), prefix_items=torch.tensor(h.items),
                          prefix_timestamps=torch.tensor(h.timestamps))
        torch.testing.assert_close(torch.tensor(out["scores"]), want, atol=SCORE_TOL,
                                   rtol=SCORE_TOL)


def _by_request(rows: list[LegRecord]) -> dict[str, dict[str, LegRecord]]:
    legs: dict[str, dict[str, LegRecord]] = defaultdict(dict)
    for row in rows:
        legs[row.request_id][row.leg] = row
    return legs


def _recommend(url: str, users: list[int], workers: int = 4) -> list[httpx.Response]:
    with httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda u: client.post("/v1/recommend", json={"user_id": u}),
                             users))


def test_both_legs_land_on_the_replica_that_owns_the_user(cluster: Cluster) -> None:
    users = [1 + i % 12 for i in range(36)]
    responses = _recommend(cluster.url, users)
    _check_scores(responses)
    legs = _by_request(read_ledger(cluster.ledger))
    assert len(legs) == 36
    spilled = 0
    owner: dict[int, set[str]] = defaultdict(set)
    for pair in legs.values():
        pre, rank = pair["preinfer"], pair["rank"]
        assert rank.routed_to == rank.replica and pre.routed_to == pre.replica
        if pre.spilled:
            spilled += 1
            continue
        assert pre.replica == rank.replica          # both legs met on one replica
        owner[rank.user_id].add(rank.replica)
    assert spilled <= 4
    assert all(len(replicas) == 1 for replicas in owner.values())   # one owner per user
    assert len({r for rs in owner.values() for r in rs}) == 2          # users spread over both
    for r in responses:
        out = r.json()
        assert out["preinfer"]["instance"] == out["instance"]
    print(f"\n[ray] 36 requests, {spilled} spilled, owners {dict(owner)}")


def test_killing_a_replica_under_load_loses_no_request(cluster: Cluster) -> None:
    import ray

    before = read_ledger(cluster.ledger)
    owner = {row.user_id: row.replica for row in before if row.leg == "rank"}
    victim = sorted(set(owner.values()))[0]
    moved_users = sorted(u for u, r in owner.items() if r == victim)
    assert moved_users
    users = [1 + i % 12 for i in range(60)]
    done = 0
    lock = threading.Lock()

    def kill_when_a_fifth_is_done(r: httpx.Response) -> httpx.Response:
        nonlocal done
        with lock:
            done += 1
            due = done == len(users) // 5
        if due:               # the other workers' requests are in flight meanwhile
            ray.kill(ray.get_actor(f"SERVE_REPLICA::relaygr#RankingReplica#{victim}",
                                   namespace="serve"), no_restart=True)
        return r

    with httpx.Client(base_url=cluster.url, timeout=60) as client, ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda u: kill_when_a_fifth_is_done(
            client.post("/v1/recommend", json={"user_id": u})), users))
    _check_scores(responses)                          # every request answered, exactly
    after = _recommend(cluster.url, moved_users, workers=2)
    _check_scores(after)
    assert all(r.json()["instance"] != victim for r in after)       # its users moved
    late = [r.json() for r in responses[len(users) // 5 + 4:] if r.json()["user_id"]
            in moved_users]
    assert late and all(out["instance"] != victim for out in late)
    metrics = httpx.get(f"{cluster.url}/metrics").text
    failovers = [line for line in metrics.splitlines()
                 if line.startswith("relaygr_failovers_total")]
    print(f"\n[ray] killed {victim} after {len(users) // 5} of {len(users)} requests; all "
          f"answered; {failovers}; its users {moved_users} now on "
          f"{sorted({r.json()['instance'] for r in after})}")
