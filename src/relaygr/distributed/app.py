"""The Ray Serve application: an ingress deployment over a ranking deployment of N replicas.

::

    HTTP ─► Serve proxy ─► RelayIngress (FastAPI app, cascade, history store, retrieval stage)
                              │  handle.preinfer / handle.rank (both legs, same user)
                              ▼
                     RelayRequestRouter (relaygr's router, in the ingress process)
                              ▼
                RankingReplica × N (one RankingInstance each, one accelerator each)

``build_application(spec)`` binds the two deployments; ``serve_forever(options)`` is
``relaygr serve --ray``: settle what it deploys before any cluster starts (``driver_system``, in
the embedded server's order: the model, the retrieval run, the served data against the run's
record, then the users), start or join a cluster, run the app behind Serve's HTTP proxy, and on
SIGINT/SIGTERM shut Serve down (replicas drain their requests first). A trained retrieval stage
(``ModelSource.retrieval_run``) is checked by the driver and loaded by each ingress replica from
its run directory (``ingress_service``); it runs there, on the ingress's CPU. Unless the system
config gives them, the replicas' cache budgets are sized as the embedded server sizes its
instances' (``ray_budgets``: from the model, the users and the memory of the machine that runs
it).
"""

from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
import torch
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig

import relaygr
from relaygr.cascade.config import SystemConfig
from relaygr.cascade.modes import Mode, spec_for
from relaygr.cascade.window import HistoryWindow
from relaygr.distributed.health import HealthCheckPolicy
from relaygr.distributed.ingress import RayBackend
from relaygr.distributed.replica import RankingReplica, ReplicaSpec
from relaygr.distributed.router import RelayRequestRouter
from relaygr.engine.hostmem import release_free_memory, tune_host_allocator
from relaygr.errors import ConfigError
from relaygr.model import HSTU
from relaygr.model.digest import model_digest
from relaygr.server.app import create_app
from relaygr.server.build import (
    load_catalog,
    load_cost_model,
    load_model,
    load_retrieval,
    load_store,
    model_info,
    served_timed,
    sized_budgets,
)
from relaygr.server.config import (
    ModelSource,
    ServeOptions,
    ServerConfig,
    check_ingress_replicas,
)
from relaygr.server.served_data import check_served_data
from relaygr.server.service import RelayService

APP_NAME = "relaygr"
# Where the ingress computes (its model copy, the retrieval stage): it reserves CPUs only.
INGRESS_DEVICE = "cpu"


@dataclass(frozen=True)
class IngressSpec:
    model: ModelSource
    model_digest: str
    system: SystemConfig
    server: ServerConfig
    # Ranking tries per request before giving up (each failover goes to the next choice).
    max_attempts: int = 4
    torch_threads: int | None = None


@serve.ingress()
class RelayIngress:
    """The ingress deployment (see ``relaygr.distributed.ingress``)."""

    def __init__(self, ranker: Any, spec: IngressSpec) -> None:
        tune_host_allocator()
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.service = ingress_service(ranker, spec)

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.service)


def ingress_service(ranker: Any, spec: IngressSpec) -> RelayService:
    """What an ingress replica serves: the model (``ConfigError`` when its digest is not the
    driver's), the users' store, the retrieval stage of ``spec.model.retrieval_run`` (None: the
    model's item embeddings), loaded here from the run directory, which every ingress node must
    be able to read, and run on this process's CPU (``INGRESS_DEVICE``), and a ``RelayService``
    over a ``RayBackend`` sending the ranking legs to ``ranker`` (a handle of the ranking
    deployment, or a stand-in with its methods)."""
    model = load_model(spec.model)
    if model_digest(model) != spec.model_digest:
        raise ConfigError("the ingress built a different model than the driver")
    # the run before the users: a run that does not fit fails before the store is opened
    retrieval = load_retrieval(spec.model, spec.system, model, device=INGRESS_DEVICE)
    store = load_store(spec.model, model, HistoryWindow.for_model(model.cfg, spec.system))
    try:
        release_free_memory()   # what reading the dataset freed (see engine.hostmem)
        backend = RayBackend(ranker, model, store, spec.system, spec.max_attempts, retrieval)
        return RelayService(backend, spec.server, load_catalog(spec.model, model),
                            model_info(spec.model, model), timed=served_timed(spec.model))
    except BaseException:
        store.close()
        raise


@dataclass(frozen=True)
class RayAppSpec:
    """The whole application: model, relay settings, replicas and their resources."""

    model: ModelSource
    system: SystemConfig
    server: ServerConfig
    replicas: int = 2
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    ingress_cpus: float = 1.0
    # Ingress replicas (each runs the cascade and the HTTP API); more than one share the users'
    # histories through the model's shared history store (``ModelSource.history_store``).
    ingress_replicas: int = 1
    device: str = "cpu"
    cost_model: dict[str, Any] | None = None     # None: each replica times its own device
    ledger_dir: Path | None = None
    torch_threads: int | None = None
    # Ray Serve's own per-replica cap; the instance sheds at its own (lower) queue depths.
    max_ongoing_requests: int = 1024
    # Serve's health checks of the ranking replicas and what counts as stuck (see its fields).
    health: HealthCheckPolicy = field(default_factory=HealthCheckPolicy)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"RayAppSpec.replicas must be >= 1, got {self.replicas}")
        check_ingress_replicas(self.ingress_replicas, self.model)



@dataclass(frozen=True)
class CpuShares:
    """CPUs Ray reserves for the ingress and for each ranking replica."""

    ingress: float
    replica: float


def plan_cpu_shares(cluster_cpus: float, replicas: int, replica_cpus: float | None,
                    ingress_cpus: float | None = None, ingresses: int = 1) -> CpuShares:
    """Shares that fit ``cluster_cpus``: each replica (the ``ingresses`` ingress replicas and
    every ranking replica) gets an equal share of the cluster, at most one CPU, unless given.
    Shares that cannot all be placed are refused up front with the arithmetic (Ray would
    otherwise leave replicas pending, and ``serve.run`` would wait for them without a word)."""
    auto = min(1.0, math.floor(100 * cluster_cpus / (replicas + ingresses)) / 100)
    shares = CpuShares(auto if ingress_cpus is None else ingress_cpus,
                       auto if replica_cpus is None else replica_cpus)
    need = ingresses * shares.ingress + replicas * shares.replica
    if shares.ingress <= 0 or shares.replica <= 0 or need > cluster_cpus + 1e-9:
        raise ConfigError(
            f"{ingresses} ingress x {shares.ingress:g} CPU and {replicas} replicas x "
            f"{shares.replica:g} CPU need {need:g} CPUs; the Ray cluster has {cluster_cpus:g}. "
            "Pass --replica-cpus (e.g. "
            f"{math.floor(100 * (cluster_cpus - ingresses * shares.ingress) / replicas) / 100:g})"
            " or fewer "
            "--replicas")
    return shares


def router_config(system: SystemConfig) -> RequestRouterConfig:
    """Serve's request router for the ranking deployment: the mode's relaygr router."""
    mode = spec_for(Mode.parse(system.mode))
    settings: dict[str, Any] = {"router": mode.router, **mode.router_settings(system.affinity)}
    router_class: Any = RelayRequestRouter     # Serve takes a class or its import path
    return RequestRouterConfig(request_router_class=router_class,
                               request_router_kwargs=settings)


def ranking_deployment_options(spec: RayAppSpec) -> dict[str, Any]:
    """The ranking deployment's Serve options: replicas, resources, the request router, and
    the health checks that replace a replica whose instance is not serving
    (``RankingReplica.check_health``)."""
    return {"name": "RankingReplica", "num_replicas": spec.replicas,
            "ray_actor_options": {"num_cpus": spec.replica_cpus, "num_gpus": spec.replica_gpus},
            "max_ongoing_requests": spec.max_ongoing_requests,
            "request_router_config": router_config(spec.system),
            "health_check_period_s": spec.health.period_s,
            "health_check_timeout_s": spec.health.timeout_s}


def build_application(spec: RayAppSpec, log: Callable[[str], None] = lambda _: None,
                      settled: HSTU | None = None) -> Any:
    """The bound Serve application (pass it to ``serve.run``). Needs no running cluster. A
    retrieval run (``spec.model.retrieval_run``) is loaded here once, as the ingress will load
    it, so a run that does not fit the model is refused now with the embedded server's typed
    error (``load_retrieval``), not as an ingress that fails to start; ``log`` hears what it
    is. The application carries the run's path, not the loaded stage. ``settled``: the served
    model, already loaded and checked with the run by the caller (``serve_forever``'s
    ``driver_system``), so that neither is loaded again."""
    model = load_model(spec.model) if settled is None else settled
    digest = model_digest(model)
    if settled is None:
        load_retrieval(spec.model, spec.system, model, log, device=INGRESS_DEVICE)
    replica = ReplicaSpec(spec.model, digest, spec.system, spec.device, spec.cost_model,
                          spec.ledger_dir, spec.torch_threads, health=spec.health)
    deployment: Any = serve.deployment
    ranker = deployment(RankingReplica).options(**ranking_deployment_options(spec))
    ingress = deployment(RelayIngress).options(
        name="RelayIngress", num_replicas=spec.ingress_replicas,
        ray_actor_options={"num_cpus": spec.ingress_cpus},
        max_ongoing_requests=spec.server.max_in_flight + 64)
    return ingress.bind(ranker.bind(replica), IngressSpec(
        spec.model, digest, spec.system, spec.server, torch_threads=spec.torch_threads))


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start (or join) Ray so that its workers import this relaygr (the same source tree)."""
    src = str(Path(relaygr.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(address=address, num_cpus=num_cpus, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False)


def _warn_while_pending(done: threading.Event, after_s: float, shares: CpuShares,
                        replicas: int) -> None:
    """Say so when the application is still not running after ``after_s`` (and every
    ``after_s`` after that): replicas Ray cannot place wait silently otherwise."""
    while not done.wait(after_s):
        cpus = ray.cluster_resources().get("CPU", 0.0)
        print(f"relaygr: still waiting for the ingress and {replicas} replicas "
              f"({shares.ingress:g} + {replicas} x {shares.replica:g} CPUs of the cluster's "
              f"{cpus:g}): see `ray status` for pending actors", flush=True)


def driver_system(options: ServeOptions, model: HSTU,
                  log: Callable[[str], None]) -> SystemConfig:
    """The system the driver deploys, settled before it starts or joins a cluster and in the
    embedded server's order (``server.build.build_embedded``): the model, the retrieval run
    (``load_retrieval``: one that does not fit is refused), the served data against the run's
    record (``CatalogueMismatchError`` for other data; ``server.served_data``), and only then
    the users, read to size the replicas' budgets (``ray_budgets``). Other data is refused
    here, before any user is built, and not by an ingress replica that never starts inside the
    cluster. ``model``: the served one (``load_model(options.model)``), loaded once by the
    driver for all of this, the cost model and the application."""
    load_retrieval(options.model, options.system, model, log, device=INGRESS_DEVICE)
    if options.size_budgets:    # reading the users checks their data before it builds them
        return ray_budgets(options, model, log)
    check_served_data(options.model)
    return options.system


def ray_budgets(options: ServeOptions, model: HSTU, log: Callable[[str], None]) -> SystemConfig:
    """``options.system`` with each ranking replica's cache budgets sized from ``model`` (the
    served one) and the users for ``options.replicas`` replicas (``server.build.sized_budgets``;
    ``log`` hears how), or as given when the system config gave them. The users are read here
    once for it, from the dataset or synthetic (not the shared store nor the event log: the
    ingress owns those), then dropped and their memory handed back."""
    if not options.size_budgets:
        return options.system
    users = load_store(replace(options.model, events=None, history_store=None), model,
                       HistoryWindow.for_model(model.cfg, options.system))
    sized = sized_budgets(options.system.with_(num_instances=options.replicas), model, users,
                          log)
    del users
    release_free_memory()
    return options.system.with_(instance={
        "device_budget_bytes": sized.instance.device_budget_bytes,
        "host_budget_bytes": sized.instance.host_budget_bytes})


def serve_forever(options: ServeOptions) -> int:
    """``relaygr serve --ray`` (see the module docstring)."""
    gpus = torch.cuda.device_count()
    device = options.system.devices[0]
    model = load_model(options.model)
    system = driver_system(options, model, _say)
    cost_model = None
    if options.cost_model is not None:
        cost_model = load_cost_model(options.cost_model, model, device).to_dict()
    init_ray(options.ray_address)
    shares = plan_cpu_shares(ray.cluster_resources().get("CPU", 0.0), options.replicas,
                             options.replica_cpus, ingresses=options.ingress_replicas)
    spec = RayAppSpec(options.model, system, options.server, options.replicas,
                      shares.replica, 1.0 if gpus and device.startswith("cuda") else 0.0,
                      ingress_cpus=shares.ingress, ingress_replicas=options.ingress_replicas,
                      device=device, cost_model=cost_model)
    print(f"relaygr: Ray cluster of {ray.cluster_resources().get('CPU', 0.0):g} CPUs: "
          f"{spec.ingress_replicas} ingress x {shares.ingress:g}, {spec.replicas} replicas x "
          f"{shares.replica:g}", flush=True)
    serve.start(http_options=HTTPOptions(host=options.server.host, port=options.server.port))
    running = threading.Event()
    threading.Thread(target=_warn_while_pending, args=(running, 20.0, shares, spec.replicas),
                     daemon=True).start()
    try:
        serve.run(build_application(spec, _say, settled=model), name=APP_NAME,
                  route_prefix="/")
    finally:
        running.set()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"relaygr: serving on http://{options.server.host}:{options.server.port} "
          f"({spec.replicas} ranking replicas); Ctrl-C drains and stops")
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


def _say(line: str) -> None:
    """The driver's log line (its start-up and the application's build)."""
    print(f"relaygr: {line}", flush=True)
