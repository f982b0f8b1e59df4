"""relaygr's routers as a Ray Serve request router (``ray.serve.request_router.RequestRouter``).

Ray Serve asks ``choose_replicas`` where each call to the ranking deployment goes. For a user
call (``RoutedCall`` with a ``user_id``) the answer is relaygr's own router (the mode's: the
``AffinityRouter`` for the relay) over the running replicas, named by their replica ids,
with Serve's per-replica queue lengths as the load signal: ``route`` for a first leg,
``follow`` for a second leg that names its first leg's replica. The affinity decision is a
pure function of user id and membership, so every ingress process agrees on it without shared
state. Replicas the call lists in ``avoid`` count as
unhealthy (failover to the user's next choice); a control call with ``target`` goes to exactly
that replica (any replica answers when it has left); anything else may go to any replica.

The returned rank holds one replica only: Serve waits (backs off) while that replica is at its
``max_ongoing_requests`` rather than sending the leg elsewhere, because elsewhere has no cache.
Built on Serve's base ``RequestRouter`` without ``FIFOMixin``: a replica chosen for a call is
assigned to that same call, never to another queued one.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from relaygr.engine.transport.messages import RoutedCall, RouteNote
from relaygr.routing import (
    AffinityRouter,
    InstanceView,
    RouteDecision,
    Router,
    RouteReason,
    make_router,
)


def routed_call(pending: PendingRequest | None) -> RoutedCall | None:
    """The relaygr call a pending request carries, if any (its first positional argument)."""
    if pending is None or not pending.args:
        return None
    call = pending.args[0]
    return call if isinstance(call, RoutedCall) else None


class RelayRequestRouter(RequestRouter):
    """See the module docstring. ``initialize_state(router="affinity", **settings)`` picks the
    policy by name (``relaygr.routing.make_router``)."""

    def initialize_state(self, router: str = AffinityRouter.name, **settings: Any) -> None:
        self.policy: Router = make_router(router, **settings)

    def _queue_depth(self, replica: RunningReplica) -> int:
        depth = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if depth is None else int(depth)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        call = routed_call(pending_request)
        if call is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if call.target is not None:
            # A target that left is answered by any replica (its reply names who answered).
            return [[by_id[call.target]]] if call.target in by_id else [candidate_replicas]
        if call.user_id is None:
            return [candidate_replicas]
        note = self.decide(call, [(rid, self._queue_depth(r)) for rid, r in by_id.items()])
        call.note = note
        return [[by_id[note.instance_id]]]

    def decide(self, call: RoutedCall, replicas: list[tuple[str, int]]) -> RouteNote:
        """The affinity decision for ``call`` over ``(replica id, queue depth)`` pairs."""
        assert call.user_id is not None
        avoid = set(call.avoid)
        if all(rid in avoid for rid, _ in replicas):
            avoid = set()               # every replica failed once: try them all again
        views = [InstanceView(rid, rid not in avoid, depth) for rid, depth in replicas]
        if call.follow is not None:
            first = RouteDecision(call.user_id, call.follow.instance_id, 0, call.follow.spilled,
                                  RouteReason.FOLLOWED)
            decision = self.policy.follow(first, views)
        else:
            decision = self.policy.route(call.user_id, views)
        return RouteNote(decision.instance_id, decision.reason.value, decision.spilled)
