"""Serving across machines with Ray Serve (``relaygr serve --ray``).

Layers (lower never imports upper): ``ledger``, ``router``, ``health`` <- ``replica``, ``ingress``
<- ``app``.
Everything here reuses the embedded code: the messages are ``relaygr.engine.transport.messages``
(the worker processes' too), a replica is a ``RankingInstance`` built by
``relaygr.cascade.instances.build_instance``, the request router is ``relaygr.routing``'s router,
the ingress drives ``relaygr.cascade.request_path`` (the embedded system's request path) over the
replicas, and serves ``relaygr.server``'s app and service. This package imports Ray; nothing below
it does.

Public names: ``RelayRequestRouter``, ``RankingReplica``, ``ReplicaSpec``, ``RayBackend``,
``RelayIngress``, ``RayAppSpec``, ``build_application``, ``init_ray``, ``read_ledger``.
"""

from relaygr.distributed.app import (
    RayAppSpec,
    RelayIngress,
    build_application,
    init_ray,
    serve_forever,
)
from relaygr.distributed.ingress import RayBackend
from relaygr.distributed.ledger import LegRecord, read_ledger
from relaygr.distributed.replica import RankingReplica, ReplicaSpec
from relaygr.distributed.router import RelayRequestRouter

__all__ = ["LegRecord", "RankingReplica", "RayAppSpec", "RayBackend", "RelayIngress",
           "RelayRequestRouter", "ReplicaSpec", "build_application", "init_ray", "read_ledger",
           "serve_forever"]
