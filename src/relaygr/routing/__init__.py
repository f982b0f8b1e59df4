"""Routing of a request's two legs to ranking instances.

Public names: ``Router``, ``make_router``, ``ROUTERS``, ``AffinityRouter`` (+ ``AffinityConfig``),
``RoundRobinRouter``, ``RandomRouter``, ``LeastLoadedRouter``, ``InstanceView``,
``RouteDecision``, ``RouteReason``, ``rendezvous_order``.

Layers (lower never imports upper): ``hashing`` <- ``types`` <- ``base`` <- ``affinity`` /
``baselines`` <- ``registry``. Nothing here imports the engine or the cache: a router sees an
instance only as an ``InstanceView``.
"""

from relaygr.routing.affinity import AffinityConfig, AffinityRouter
from relaygr.routing.base import Router, rendezvous_order
from relaygr.routing.baselines import LeastLoadedRouter, RandomRouter, RoundRobinRouter
from relaygr.routing.registry import ROUTERS, make_router
from relaygr.routing.types import InstanceView, RouteDecision, RouteReason

__all__ = ["ROUTERS", "AffinityConfig", "AffinityRouter", "InstanceView", "LeastLoadedRouter",
           "RandomRouter", "RoundRobinRouter", "RouteDecision", "RouteReason", "Router",
           "make_router", "rendezvous_order"]
