"""Baseline routers and the router registry."""

from __future__ import annotations

from collections import Counter

import pytest

from relaygr.errors import ConfigError
from relaygr.routing import (
    ROUTERS,
    InstanceView,
    LeastLoadedRouter,
    RouteDecision,
    RouteReason,
    make_router,
    rendezvous_order,
)


def test_round_robin_cycles_over_healthy_instances_on_every_leg() -> None:
    router = make_router("round-robin")
    inst = [InstanceView("a"), InstanceView("b", healthy=False), InstanceView("c")]
    picks = [router.route(9, inst).instance_id for _ in range(5)]
    assert picks == ["a", "c", "a", "c", "a"]
    first = router.route(9, inst)
    assert first == RouteDecision(9, "c", 1, False, RouteReason.ROUND_ROBIN)
    # No affinity: the second leg is routed on its own and goes to the next one.
    assert router.follow(first, inst).instance_id == "a"


def test_random_is_reproducible_from_its_seed_and_roughly_uniform() -> None:
    inst = [InstanceView(n) for n in "abcd"]
    one, two = make_router("random", seed=3), make_router("random", seed=3)
    seq_one = [one.route(u, inst).instance_id for u in range(4000)]
    seq_two = [two.route(u, inst).instance_id for u in range(4000)]
    other = make_router("random", seed=4)
    assert seq_one == seq_two
    assert seq_one != [other.route(u, inst).instance_id for u in range(4000)]
    counts = Counter(seq_one)
    assert set(counts) == set("abcd")
    assert all(900 < c < 1100 for c in counts.values()), counts


def test_least_loaded_picks_the_shortest_queue_and_breaks_ties_by_user_order() -> None:
    router = LeastLoadedRouter()
    inst = [InstanceView("a", True, 3), InstanceView("b", True, 1), InstanceView("c", True, 2),
            InstanceView("d", False, 0)]
    decision = router.route(42, inst)
    assert decision.instance_id == "b"
    assert decision.rank == rendezvous_order(42, ["a", "b", "c"]).index("b")
    assert decision.reason is RouteReason.LEAST_LOADED
    idle = [InstanceView(n) for n in "abc"]
    for user in range(50):
        assert router.route(user, idle).instance_id == rendezvous_order(user, ["a", "b", "c"])[0]
    spread = Counter(router.route(u, idle).instance_id for u in range(600))
    assert all(c > 150 for c in spread.values()), spread


def test_registry_rejects_unknown_names_and_settings() -> None:
    assert sorted(ROUTERS) == ["affinity", "least-loaded", "random", "round-robin"]
    with pytest.raises(ConfigError, match="unknown router"):
        make_router("hash")
    with pytest.raises(ConfigError, match="unknown settings"):
        make_router("affinity", spill=3)
    with pytest.raises(ConfigError, match="unknown settings"):
        make_router("round-robin", seed=1)
    with pytest.raises(ConfigError, match="max_spill_hops"):
        make_router("affinity", max_spill_hops=-1)
    with pytest.raises(ConfigError, match="seed"):
        make_router("random", seed="x")
