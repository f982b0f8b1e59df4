"""On a real local Ray cluster: two ingress replicas share the users' histories in Redis.

Serve spreads requests over the ingress replicas; every append must land in the one shared
history, so each answer's ``num_events`` counts every append before it, whichever replica took
which (with a store per replica the counts would diverge), and the store holds them all.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from relaygr.cascade.redis_store import RedisHistoryStore
from relaygr.server import ServerConfig
from relaygr.server.build import load_model
from tests.engine.helpers import flops_cost_model
from tests.redis_server import RedisServer
from tests.server.helpers import SOURCE, system_config

pytestmark = [pytest.mark.slow, pytest.mark.ray]

T0 = 1_900_000_000          # after every synthetic event


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def app_url(redis_server: RedisServer) -> Iterator[tuple[str, str]]:
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.serve.config import HTTPOptions

    from relaygr.distributed.app import RayAppSpec, build_application, init_ray

    redis_server.flush()
    source = replace(SOURCE, history_store=redis_server.url)
    init_ray(num_cpus=2)
    port = _free_port()
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
        spec = RayAppSpec(source, system_config(), ServerConfig(), replicas=1, replica_cpus=0.5,
                          ingress_cpus=0.5, ingress_replicas=2,
                          cost_model=flops_cost_model(load_model(source).cfg).to_dict(),
                          torch_threads=1)
        serve.run(build_application(spec), name="relaygr", route_prefix="/")
        yield f"http://127.0.0.1:{port}", redis_server.url
    finally:
        serve.shutdown()
        ray.shutdown()


def test_ingress_replicas_append_to_one_shared_history(app_url: tuple[str, str]) -> None:
    url, store_url = app_url
    store = RedisHistoryStore.connect(store_url, num_items=SOURCE.num_items)
    assert len(store) == SOURCE.num_users          # both replicas started; users added once
    base = {u: store.num_events(u) for u in (1, 2, 3)}
    with httpx.Client(base_url=url, timeout=60) as client:
        for step in range(10):
            for user in (1, 2, 3):
                r = client.post("/v1/events", json={"user_id": user, "items": [10 + step],
                                                    "timestamps": [T0 + step]})
                assert r.status_code == 200, r.text
                assert r.json()["num_events"] == base[user] + step + 1
        r = client.post("/v1/recommend", json={"user_id": 1})
        assert r.status_code == 200, r.text
    for user in (1, 2, 3):
        assert store.get(user).items[-10:].tolist() == [10 + step for step in range(10)]
    store.check_integrity()
