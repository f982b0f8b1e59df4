"""Wire types: a prefix sent as events rebuilds the store's versions; replicas check the model."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.cascade.store import InMemoryHistoryStore
from relaygr.distributed.replica import RankingReplica
from relaygr.engine.transport.messages import RankCall, RouteNote
from relaygr.engine.transport.payload import UNKNOWN_VERSION, PrefixPayload
from relaygr.errors import ConfigError
from relaygr.kvcache import PrefixId
from tests.distributed.helpers import replica_spec
from tests.server.helpers import system_config


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), timed=st.booleans(),
       seed=st.integers(0, 1000))
def test_payload_versions_equal_the_store_versions(lengths: list[int], timed: bool,
                                                   seed: int) -> None:
    rng = np.random.default_rng(seed)
    store = InMemoryHistoryStore(num_items=100)
    clock = 1_000
    for n in lengths:                      # appended in several calls, like a real history
        ts = None
        if timed:
            ts = clock + np.cumsum(rng.integers(0, 50, n))
            clock = int(ts[-1])
        store.append(3, rng.integers(1, 101, n), ts)
    h = store.get(3)
    payload = PrefixPayload(PrefixId(3, h.num_events, h.version), np.asarray(h.items),
                            None if h.timestamps is None else np.asarray(h.timestamps))
    spec = pickle.loads(pickle.dumps(payload)).to_spec()
    for k in range(h.num_events + 1):
        assert spec.version_at(k) == store.version_at(3, k)


def test_foreign_versions_disable_partial_reuse_only() -> None:
    items = np.arange(1, 9, dtype=np.int64)
    spec = PrefixPayload(PrefixId(1, 8, 12345), items, None).to_spec()
    assert spec.version_at(8) == 12345
    assert spec.version_at(4) == UNKNOWN_VERSION


def test_calls_pickle_with_their_routing_note() -> None:
    payload = PrefixPayload(PrefixId(1, 2, 3), np.array([1, 2]), None)
    call = RankCall(request_id="x", user_id=1, prefix=payload, candidates=np.array([4]))
    call.note = RouteNote("r1", "owner", False)
    back = pickle.loads(pickle.dumps(call))
    assert back.note == call.note and back.user_id == 1


def test_replica_refuses_a_different_model() -> None:
    spec = replica_spec(system_config(), "r0", None)
    with pytest.raises(ConfigError, match="different model"):
        RankingReplica(replace(spec, model_digest="0" * 32))
