"""The Serve request router makes relaygr's affinity decisions: owner, follow, avoid, target."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.engine.transport.messages import ControlCall, RoutedCall, RouteNote
from relaygr.routing import rendezvous_order
from tests.distributed.helpers import choose, make_router

NAMES = ["a1b2c3", "d4e5f6", "g7h8i9"]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_first_leg_goes_to_the_rendezvous_owner_and_is_noted() -> None:
    router = make_router(router="affinity")
    for user in range(40):
        call = RoutedCall(request_id="r", user_id=user)
        ranks = run(choose(router, NAMES, call))
        owner = rendezvous_order(user, NAMES)[0]
        assert ranks == [[owner]]
        assert call.note == RouteNote(owner, "owner", False)


def test_second_leg_follows_the_first_even_onto_a_busy_replica() -> None:
    router = make_router(router="affinity", spill_queue_depth=2)
    user = 7
    owner, second = rendezvous_order(user, NAMES)[:2]
    from tests.distributed.helpers import fake_replica
    router.replica_queue_len_cache.update(fake_replica(owner).replica_id, 50)
    first = RoutedCall(request_id="r", user_id=user)
    assert run(choose(router, NAMES, first)) == [[second]]          # the first leg spilled
    assert first.note == RouteNote(second, "spilled", True)
    leg2 = RoutedCall(request_id="r", user_id=user, follow=first.note)
    router.replica_queue_len_cache.update(fake_replica(second).replica_id, 50)
    assert run(choose(router, NAMES, leg2)) == [[second]]           # follows, busy or not
    assert leg2.note == RouteNote(second, "followed", True)


def test_avoided_replicas_fail_over_to_the_next_choice() -> None:
    router = make_router(router="affinity")
    user = 11
    order = rendezvous_order(user, NAMES)
    call = RoutedCall(request_id="r", user_id=user, follow=RouteNote(order[0], "owner", False),
                      avoid=(order[0],))
    assert run(choose(router, NAMES, call)) == [[order[1]]]
    assert call.note is not None and call.note.reason == "failover"
    everything = RoutedCall(request_id="r", user_id=user, avoid=tuple(NAMES))
    assert run(choose(router, NAMES, everything)) == [[order[0]]]   # all failed once: retry


def test_control_calls_and_foreign_calls() -> None:
    router = make_router(router="affinity")
    assert run(choose(router, NAMES, ControlCall(request_id="c", target=NAMES[2]))) == \
        [[NAMES[2]]]
    assert run(choose(router, NAMES, ControlCall(request_id="c", target="gone"))) == [NAMES]
    assert run(choose(router, NAMES, ControlCall(request_id="c"))) == [NAMES]
    assert run(choose(router, NAMES, {"user_id": 3})) == [NAMES]    # not a relaygr call


def test_baseline_router_by_name() -> None:
    router = make_router(router="round-robin")
    picks = [run(choose(router, NAMES, RoutedCall(request_id="r", user_id=5)))[0][0]
             for _ in range(6)]
    assert picks == NAMES + NAMES


@settings(max_examples=60, deadline=None)
@given(user=st.integers(0, 2**64 - 1), size=st.integers(2, 6), gone=st.integers(0, 5))
def test_ownership_depends_only_on_user_and_membership(user: int, size: int, gone: int) -> None:
    names = [f"replica-{i}" for i in range(size)]
    router = make_router(router="affinity")
    call = RoutedCall(request_id="r", user_id=user)
    [[owner]] = run(choose(router, names, call))
    assert owner == rendezvous_order(user, names)[0]
    assert run(choose(make_router(router="affinity"), names,
                      RoutedCall(request_id="r", user_id=user, follow=call.note))) == [[owner]]
    leaver = names[gone % size]
    rest = [n for n in names if n != leaver]
    [[after]] = run(choose(router, rest, RoutedCall(request_id="r", user_id=user)))
    # Only the leaver's users move (minimal disruption), each to its next choice.
    assert after == owner if leaver != owner else after == rendezvous_order(user, names)[1]
