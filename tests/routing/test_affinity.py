"""Affinity router: stable placement, balance, minimal disruption, bounded spill, follow."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.errors import InvalidInputError, NoHealthyInstanceError
from relaygr.routing import (
    AffinityConfig,
    AffinityRouter,
    InstanceView,
    RouteDecision,
    RouteReason,
    make_router,
    rendezvous_order,
)


def members(k: int, depth: int = 0) -> list[InstanceView]:
    return [InstanceView(f"rank-{i}", True, depth) for i in range(k)]


def owners(router: AffinityRouter, users: range, instances: list[InstanceView]) -> dict[int, str]:
    return {u: router.route(u, instances).instance_id for u in users}


def test_two_router_objects_agree_on_every_user() -> None:
    inst = members(8)
    assert owners(AffinityRouter(), range(2000), inst) == owners(
        make_router("affinity"), range(2000), inst)  # type: ignore[arg-type]


def test_placement_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = ("from relaygr.routing import rendezvous_order;"
            "print([rendezvous_order(u, ['a', 'b', 'c', 'd'])[0] for u in range(50)])")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH="src")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    here = [rendezvous_order(u, ["a", "b", "c", "d"])[0] for u in range(50)]
    assert out == repr(here)


def test_order_does_not_depend_on_membership_listing_order() -> None:
    names = [f"rank-{i}" for i in range(6)]
    for user in range(200):
        assert rendezvous_order(user, names) == rendezvous_order(user, names[::-1])


def test_owners_are_balanced_over_many_users() -> None:
    k, n = 8, 20_000
    counts = Counter(owners(AffinityRouter(), range(n), members(k)).values())
    expected = n / k
    chi2 = sum((counts[f"rank-{i}"] - expected) ** 2 / expected for i in range(k))
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001 for a uniform assignment.
    assert chi2 < 24.3, counts
    assert min(counts.values()) > 0.95 * expected


def test_removing_one_instance_moves_only_its_users_to_their_next_choice() -> None:
    router = AffinityRouter()
    full = members(8)
    before = {u: router.route(u, full) for u in range(3000)}
    failed = [InstanceView(v.instance_id, v.instance_id != "rank-3", 0) for v in full]
    moved = 0
    for user, decision in before.items():
        after = router.route(user, failed)
        if decision.instance_id == "rank-3":
            moved += 1
            assert after.instance_id == rendezvous_order(user, [v.instance_id for v in full])[1]
        else:
            assert after.instance_id == decision.instance_id
        # An unhealthy member and an absent one are the same to the router.
        assert router.route(user, [v for v in failed if v.healthy]) == after
    assert 3000 / 8 * 0.8 < moved < 3000 / 8 * 1.2


@settings(max_examples=60, deadline=None)
@given(k=st.integers(2, 12), users=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40),
       joiner=st.text("abcdefgh", min_size=1, max_size=6))
def test_a_join_moves_only_users_that_now_rank_the_new_instance_first(
        k: int, users: list[int], joiner: str) -> None:
    router = AffinityRouter()
    old = members(k)
    new = [*old, InstanceView("new-" + joiner)]
    for user in users:
        before = router.route(user, old).instance_id
        after = router.route(user, new).instance_id
        assert after in (before, "new-" + joiner)


def test_spill_goes_to_the_next_choice_and_is_bounded() -> None:
    router = AffinityRouter(AffinityConfig(spill_queue_depth=4, max_spill_hops=1))
    user = 77
    order = rendezvous_order(user, [f"rank-{i}" for i in range(4)])
    depth = {order[0]: 5, order[1]: 0, order[2]: 0, order[3]: 0}
    inst = [InstanceView(name, True, depth[name]) for name in sorted(depth)]
    assert router.route(user, inst) == RouteDecision(user, order[1], 1, True, RouteReason.SPILLED)
    # At the threshold is not over it.
    depth[order[0]] = 4
    inst = [InstanceView(name, True, depth[name]) for name in sorted(depth)]
    assert router.route(user, inst) == RouteDecision(user, order[0], 0, False, RouteReason.OWNER)
    # Both choices within the hop bound over: the less loaded of the two, never order[2].
    depth.update({order[0]: 9, order[1]: 6})
    inst = [InstanceView(name, True, depth[name]) for name in sorted(depth)]
    assert router.route(user, inst) == RouteDecision(user, order[1], 1, True,
                                                     RouteReason.ALL_OVERLOADED)
    depth.update({order[0]: 6, order[1]: 6})
    inst = [InstanceView(name, True, depth[name]) for name in sorted(depth)]
    assert router.route(user, inst) == RouteDecision(user, order[0], 0, False,
                                                     RouteReason.ALL_OVERLOADED)


def test_no_hops_means_pure_user_id_routing() -> None:
    router = make_router("affinity", spill_queue_depth=0, max_spill_hops=0)
    inst = members(4, depth=50)
    for user in range(100):
        decision = router.route(user, inst)
        assert decision.instance_id == rendezvous_order(user, [v.instance_id for v in inst])[0]
        assert (decision.rank, decision.spilled) == (0, False)


def test_ranking_leg_follows_the_spill_while_that_instance_is_healthy() -> None:
    router = AffinityRouter(AffinityConfig(spill_queue_depth=2, max_spill_hops=2))
    user = 5
    order = rendezvous_order(user, [f"rank-{i}" for i in range(4)])
    busy = [InstanceView(n, True, 10 if n == order[0] else 0) for n in order]
    first = router.route(user, busy)
    assert (first.instance_id, first.spilled) == (order[1], True)
    # The owner has drained and the spill target is now busy: the second leg still follows.
    later = [InstanceView(n, True, 50 if n == order[1] else 0) for n in order]
    assert router.follow(first, later) == RouteDecision(user, order[1], 1, True,
                                                        RouteReason.FOLLOWED)
    # The spill target failed: the user's first healthy choice, no spill flag.
    failed = [InstanceView(n, n != order[1], 0) for n in order]
    assert router.follow(first, failed) == RouteDecision(user, order[0], 0, False,
                                                         RouteReason.FAILOVER)
    gone = [v for v in later if v.instance_id != order[1]]
    assert router.follow(first, gone).reason is RouteReason.FAILOVER


def test_owner_failure_moves_its_user_to_the_second_choice_for_both_legs() -> None:
    router = AffinityRouter()
    user = 1234
    order = rendezvous_order(user, [f"rank-{i}" for i in range(3)])
    first = router.route(user, members(3))
    assert first == RouteDecision(user, order[0], 0, False, RouteReason.OWNER)
    failed = [InstanceView(n, n != order[0]) for n in order]
    assert router.follow(first, failed) == RouteDecision(user, order[1], 0, False,
                                                         RouteReason.FAILOVER)
    assert router.route(user, failed) == RouteDecision(user, order[1], 0, False,
                                                       RouteReason.OWNER)


def test_bad_inputs_are_typed_errors() -> None:
    router = AffinityRouter()
    with pytest.raises(NoHealthyInstanceError):
        router.route(1, [InstanceView("a", False)])
    with pytest.raises(NoHealthyInstanceError):
        router.route(1, [])
    with pytest.raises(InvalidInputError, match="twice"):
        router.route(1, [InstanceView("a"), InstanceView("a")])
    for bad in (-1, 2**64, True, "7", 1.5):
        with pytest.raises(InvalidInputError, match="user_id"):
            router.route(bad, members(2))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="queue_depth"):
        InstanceView("a", True, -1)
    with pytest.raises(InvalidInputError, match="instance_id"):
        InstanceView("", True, 0)
