"""What ``InstanceFleet`` shows the router: each instance's ranking queue, on either transport.

The spill (``routing.affinity``) and the least-loaded baseline read ``InstanceView.queue_depth``;
pre-infer work queued on an instance is not load (``routing.types.InstanceView``), whether the
instance runs in this process or in a worker process of its own."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.fleet import InstanceFleet
from relaygr.engine.snapshot import InstanceSnapshot
from relaygr.engine.transport.process_instance import ProcessInstance
from relaygr.routing import AffinityRouter, InstanceView, rendezvous_order


def process_instance(name: str, ranks: int, preinfers: int) -> ProcessInstance:
    """A worker-process instance's handle as the parent holds it: up, with ``ranks`` ranking
    calls unanswered and ``preinfers`` pre-infer jobs queued in its host's last report."""
    handle = ProcessInstance(SimpleNamespace(alive=True), 0, None, name, "cpu")  # type: ignore[arg-type]
    handle._up = handle._open_on_host = True
    handle._ranks = ranks
    handle.last = InstanceSnapshot(name, True, ranks, preinfers, None, None)
    return handle


def test_worker_process_instances_are_seen_by_their_ranking_queue_alone() -> None:
    names = ["rank-0", "rank-1"]
    handles: list[Any] = [process_instance("rank-0", 0, 12), process_instance("rank-1", 3, 0)]
    fleet = InstanceFleet(handles, AffinityRouter(), SystemConfig(), clock=lambda: 0.0)
    assert fleet.views() == [InstanceView("rank-0", True, 0), InstanceView("rank-1", True, 3)]
    # so the owner with twelve pre-infers queued, and no ranking, keeps its users
    user = next(u for u in range(100) if rendezvous_order(u, names)[0] == "rank-0")
    assert fleet.router.route(user, fleet.views()).instance_id == "rank-0"
