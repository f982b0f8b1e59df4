"""Distributed-test helpers: in-process replicas behind the real request router, no Ray cluster.

``LocalRanker`` stands in for a Serve ``DeploymentHandle`` of the ranking deployment: each
``.remote(call)`` asks ``RelayRequestRouter.choose_replicas`` (the class Serve runs) for a
replica among the live ones and calls that ``RankingReplica``. A killed replica raises
``ActorDiedError`` as a dead Ray actor does, and stays in the membership until ``forget``, as a
replica does until Serve's controller notices. A replica's call that raises reaches the caller
as Serve hands it over: a ``RayTaskError`` that is also an instance of the error's class.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest

from relaygr.cascade.config import SystemConfig
from relaygr.distributed.replica import RankingReplica, ReplicaSpec
from relaygr.distributed.router import RelayRequestRouter
from relaygr.engine.transport.messages import RoutedCall
from relaygr.model.digest import model_digest
from relaygr.server.build import load_model
from relaygr.server.config import ModelSource
from tests.engine.helpers import flops_cost_model
from tests.server.helpers import SOURCE, system_config

DEPLOYMENT = DeploymentID(name="RankingReplica", app_name="relaygr")


def make_router(**settings: Any) -> RelayRequestRouter:
    router = RelayRequestRouter(deployment_id=DEPLOYMENT,
                                handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**settings)
    return router


def fake_replica(name: str) -> Any:
    """What ``choose_replicas`` reads of a ``RunningReplica``: its id."""
    return SimpleNamespace(replica_id=ReplicaID(name, DEPLOYMENT))


async def choose(router: RelayRequestRouter, names: list[str], call: Any) -> list[list[str]]:
    pending = PendingRequest(args=[call], kwargs={}, metadata=None)  # type: ignore[arg-type]
    ranks = await router.choose_replicas([fake_replica(n) for n in names], pending)
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def replica_spec(system: SystemConfig, name: str, ledger: Path | None,
                 source: ModelSource = SOURCE) -> ReplicaSpec:
    model = load_model(source)
    return ReplicaSpec(source, model_digest(model), system,
                       cost_model=flops_cost_model(model.cfg).to_dict(), ledger_dir=ledger,
                       name=name)


class LocalRanker:
    """A stand-in for the ranking deployment's handle (see the module docstring)."""

    def __init__(self, names: list[str], ledger: Path | None = None,
                 system: SystemConfig | None = None, source: ModelSource = SOURCE) -> None:
        self.system = system or system_config()
        self.replicas = {n: RankingReplica(replica_spec(self.system, n, ledger, source))
                         for n in names}
        self.router = make_router(router="affinity", **asdict(self.system.affinity))
        self.dead: set[str] = set()
        self.sent: list[tuple[str, str]] = []     # (method, replica) per call delivered

    def kill(self, name: str) -> None:
        self.dead.add(name)

    def forget(self, name: str) -> None:
        self.replicas.pop(name)

    def __getattr__(self, method: str) -> Any:
        ranker = self

        class Method:
            def remote(self, call: RoutedCall) -> Awaitable[Any]:
                return ranker._send(method, call)

        return Method()

    async def _send(self, method: str, call: RoutedCall) -> Any:
        [[name, *_], *_] = await choose(self.router, list(self.replicas), call)
        await asyncio.sleep(0)
        if name in self.dead:
            raise ActorDiedError()
        self.sent.append((method, name))
        try:
            return await getattr(self.replicas[name], method)(call)
        except Exception as exc:
            raise RayTaskError(method, traceback.format_exc(), exc, proctitle="replica",
                               ip="127.0.0.1").as_instanceof_cause() from None


def full_scores(user_items: Any, user_ts: Any, candidates: list[int]) -> torch.Tensor:
    model = load_model(SOURCE)
    return model.rank(torch.tensor(candidates), prefix_items=torch.tensor(user_items),
                      prefix_timestamps=None if user_ts is None else torch.tensor(user_ts))
