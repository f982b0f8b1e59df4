"""``relaygr serve``: the relay as an HTTP service (embedded instances, or Ray Serve with --ray).

Embedded (default): FastAPI on uvicorn in one process, ``--instances`` ranking instances behind
the affinity router, each in a process of its own on CPU (``--instance-processes``). ``--ray``: a
Ray Serve application (an ingress running the cascade, one ranking replica per accelerator, the
affinity router as Ray Serve's request router). Both serve the same API; SIGINT/SIGTERM drain
in-flight requests before the instances stop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from relaygr.cascade.config import MEASURED_STAGE_DELAYS, SystemConfig
from relaygr.cli.config import as_plain, device_name, positive_int
from relaygr.engine.hostmem import tune_host_allocator
from relaygr.engine.transport.processes import PLACEMENTS, wants_processes
from relaygr.errors import ConfigError
from relaygr.model import MODEL_SIZES
from relaygr.server.config import ModelSource, ServeOptions, ServerConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve ranking over HTTP (embedded, or Ray Serve)",
                       description=__doc__)
    m = p.add_argument_group("model and users")
    m.add_argument("--checkpoint", type=Path, default=None,
                   help="trained checkpoint directory (else --size with random weights)")
    m.add_argument("--dataset", default=None,
                   help="serve this dataset's users (with --checkpoint and --data-dir), e.g. ml-1m")
    m.add_argument("--data-dir", type=Path, default=None, help="where --dataset's files are")
    m.add_argument("--size", choices=sorted(MODEL_SIZES), default=ModelSource.size)
    m.add_argument("--num-items", type=int, default=ModelSource.num_items)
    m.add_argument("--max-seq-len", type=int, default=ModelSource.max_seq_len)
    m.add_argument("--num-users", type=int, default=ModelSource.num_users, help="synthetic users")
    m.add_argument("--events", default="auto",
                   help="SQLite file keeping appended events across restarts (default with "
                        "--checkpoint: RUN/events.sqlite; 'none': memory only)")
    m.add_argument("--events-adopt", action="store_true",
                   help="the --events log was written by an older relaygr that did not record "
                        "its user base: take its appends as made on the users served now")
    m.add_argument("--history-store", default=None, metavar="URL",
                   help="keep the users' histories in Redis at redis://HOST:PORT[/DB], shared "
                        "by every server process that names it (the dataset's users are added "
                        "only where absent; appends are atomic per user and kept by Redis); "
                        "default: in memory, appends kept by --events")
    m.add_argument("--synthetic-users", action="store_true",
                   help="serve --checkpoint with synthetic users instead of the users of the "
                        "data its run directory records")
    m.add_argument("--max-events", type=int, default=ModelSource.max_events,
                   help="longest synthetic history")
    m.add_argument("--retrieval-run", type=Path, default=None, metavar="RUN",
                   help="a trained run serving the retrieval stage instead of the "
                        "checkpoint's item embeddings, told apart by its files: a `relaygr "
                        "train-retrieval` run (its user tower on the user's recent events, its "
                        "item vectors in a FAISS index) or a `relaygr train` run (its "
                        "retrieval head over the user's history, as `relaygr eval --retrieval "
                        "RUN`); needs --checkpoint of the same dataset (an HSTU run: the same "
                        "item ids). Its time is measured on the request's path, so the "
                        "simulated stage delays default to 0 (a --system-config may still set "
                        "stages.retrieval_delay_ms/preprocess_delay_ms)")
    m.add_argument("--retrieval-run-share", type=float, default=None, metavar="S",
                   help="in (0, 1]: the share of the retrieved list a `relaygr train-retrieval` "
                        "--retrieval-run proposes, the rest the checkpoint's item embeddings', "
                        "interleaved (default: StagesConfig.retrieval_run_share; 1: the run "
                        "alone, whose scores a --stage-weight may then fuse)")
    m.add_argument("--retrieval-item-cf-rest-share", type=float, default=None, metavar="S",
                   help="in [0, 1]: of the retrieved list a `relaygr train-retrieval` "
                        "--retrieval-run leaves, the share the item-to-item channel of its "
                        "training interactions proposes, the rest the item embeddings' (default: "
                        "StagesConfig.retrieval_item_cf_rest_share; 0: no such channel)")
    m.add_argument("--stage-weight", type=float, default=None, metavar="W",
                   help="/v1/recommend orders by ranker score + W x the retrieval stage's "
                        "score, as `relaygr eval --stage-weight W` (default 0: the ranker "
                        "alone; StagesConfig.stage_weight)")
    m.add_argument("--seed", type=int, default=ModelSource.seed)
    s = p.add_argument_group("relay system")
    s.add_argument("--system-config", type=Path, default=None,
                   help="JSON file of SystemConfig fields, its parts nested ({\"instance\": "
                        "{\"page_tokens\": 32}, \"stages\": {...}}; flags below override it)")
    s.add_argument("--mode", default=None, help="relay (default), baseline, reactive, ...")
    s.add_argument("--instances", type=positive_int, default=None, help="ranking instances")
    s.add_argument("--instance-processes", choices=PLACEMENTS, default="auto",
                   help="run each ranking instance in a process of its own (auto: on CPU, "
                        "where instances in one process contend for its interpreter lock; on "
                        "CUDA each instance runs on a worker thread of the server's process)")
    s.add_argument("--slo-ms", type=float, default=None, help="ranking P99 budget")
    s.add_argument("--device", type=device_name, default=None,
                   help="ranking device (default: cuda when present, else cpu)")
    s.add_argument("--cost-model", type=Path, default=None,
                   help="saved cost model or `relaygr profile` JSON (default: fit at start)")
    h = p.add_argument_group("http")
    h.add_argument("--host", default=ServerConfig.host)
    h.add_argument("--port", type=int, default=ServerConfig.port)
    h.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes)
    h.add_argument("--max-in-flight", type=int, default=ServerConfig.max_in_flight)
    h.add_argument("--max-in-flight-per-user", type=int,
                   default=ServerConfig.max_in_flight_per_user)
    h.add_argument("--drain-timeout-s", type=float, default=ServerConfig.drain_timeout_s)
    h.add_argument("--log-level", default="info")
    r = p.add_argument_group("ray serve")
    r.add_argument("--ray", action="store_true", help="serve with Ray Serve")
    r.add_argument("--ray-address", default=None, help="existing cluster (default: local)")
    r.add_argument("--replicas", type=positive_int, default=None,
                   help="ranking replicas (default: one per GPU, else --instances)")
    r.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs per ranking replica (default: an equal share of the Ray cluster "
                        "with the ingress, at most 1)")
    r.add_argument("--ingress-replicas", type=int, default=1,
                   help="ingress replicas running the cascade and the HTTP API; more than one "
                        "need --history-store (they share the users' histories there)")
    p.set_defaults(func=run, effective_config=effective_config)


def _events_path(flag: str, checkpoint: Path | None, history_store: str | None,
                 synthetic_users: bool = False) -> Path | None:
    if flag == "none":
        return None
    if flag == "auto":     # a shared history store keeps its appends itself
        # synthetic users (a load test) keep theirs in memory: the checkpoint's log holds
        # the appends of the users it serves by default
        if history_store is not None or checkpoint is None or synthetic_users:
            return None
        return checkpoint / "events.sqlite"
    return Path(flag)


def _part(system_fields: dict[str, Any], name: str) -> dict[str, Any]:
    """The mapping of part ``name`` in a system config's fields, made when absent (``from_dict``
    refuses one that is not a mapping)."""
    part = system_fields.setdefault(name, {})
    return part if isinstance(part, dict) else {}


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    system_fields: dict[str, Any] = {}
    if args.system_config is not None:
        try:
            system_fields = json.loads(args.system_config.read_text())
        except (OSError, ValueError) as exc:     # missing, unreadable, a directory, not JSON
            raise ConfigError(f"--system-config {args.system_config}: cannot read it as JSON "
                              f"({exc})") from None
        if not isinstance(system_fields, dict):
            raise ConfigError(f"--system-config {args.system_config} must hold a JSON object of "
                              "SystemConfig fields")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for name, value in (("mode", args.mode), ("num_instances", args.instances),
                        ("slo_ms", args.slo_ms)):
        if value is not None:
            system_fields[name] = value
    if args.device is not None or "devices" not in system_fields:
        system_fields["devices"] = [device]
    stages = _part(system_fields, "stages")
    if args.stage_weight is not None:
        stages["stage_weight"] = args.stage_weight
    if args.retrieval_run_share is not None:
        if args.retrieval_run is None or _is_hstu_run(args.retrieval_run):
            raise ConfigError("--retrieval-run-share is the share of a `relaygr "
                              "train-retrieval` --retrieval-run (an HSTU run's retrieval head "
                              "serves alone)")
        stages["retrieval_run_share"] = args.retrieval_run_share
    if args.retrieval_item_cf_rest_share is not None:
        if args.retrieval_run is None or _is_hstu_run(args.retrieval_run):
            raise ConfigError("--retrieval-item-cf-rest-share is the share of the item-to-item "
                              "channel of a `relaygr train-retrieval` --retrieval-run (an HSTU "
                              "run's retrieval head serves alone)")
        if args.retrieval_run_share == 1 and args.retrieval_item_cf_rest_share:
            raise ConfigError("--retrieval-run-share 1 serves the run alone: it leaves no share "
                              "to --retrieval-item-cf-rest-share")
        stages["retrieval_item_cf_rest_share"] = args.retrieval_item_cf_rest_share
    if args.retrieval_run is not None:
        for name, value in MEASURED_STAGE_DELAYS.items():
            stages.setdefault(name, value)
    system = SystemConfig.from_dict(system_fields)
    model = ModelSource(size=args.size, num_items=args.num_items, max_seq_len=args.max_seq_len,
                        checkpoint=args.checkpoint, num_users=args.num_users,
                        max_events=min(args.max_events, args.max_seq_len), seed=args.seed,
                        dataset=args.dataset, data_dir=args.data_dir,
                        synthetic_users=args.synthetic_users,
                        events=_events_path(args.events, args.checkpoint,
                                            args.history_store, args.synthetic_users),
                        events_adopt=args.events_adopt,
                        history_store=args.history_store,
                        retrieval_run=args.retrieval_run)
    server = ServerConfig(host=args.host, port=args.port, max_body_bytes=args.max_body_bytes,
                          max_in_flight=args.max_in_flight,
                          max_in_flight_per_user=args.max_in_flight_per_user,
                          drain_timeout_s=args.drain_timeout_s)
    gpus = torch.cuda.device_count()
    replicas = args.replicas or (gpus if gpus else system.num_instances)
    in_processes = wants_processes(args.instance_processes, system.devices[0])
    sized = not {"device_budget_bytes", "host_budget_bytes"} & set(system_fields.get("instance",
                                                                                   {}))
    if args.ingress_replicas != 1 and not args.ray:
        raise ConfigError("--ingress-replicas is for --ray (embedded, one process serves)")
    return ServeOptions(model, system, server, args.cost_model, args.ray, args.ray_address,
                        replicas, args.replica_cpus, args.log_level, in_processes, sized,
                        ingress_replicas=args.ingress_replicas)


def effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """``relaygr config show serve ...``: the validated ServeOptions (with ``size_budgets``
    true, the cache budgets shown are replaced at start-up by ones sized from the model)."""
    return as_plain(options_from_args(args))


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    tune_host_allocator()  # see relaygr.engine.hostmem
    if options.ray:
        from relaygr.distributed.app import serve_forever  # Ray is only needed here
        return serve_forever(options)
    return serve_embedded(options)


def serve_embedded(options: ServeOptions) -> int:
    import uvicorn

    from relaygr.server.app import create_app
    from relaygr.server.build import build_embedded

    service = build_embedded(options.model, options.system, options.server, options.cost_model,
                             instance_processes=options.instance_processes,
                             size_budgets=options.size_budgets,
                             log=lambda line: print(f"relaygr serve: {line}", flush=True))
    config = uvicorn.Config(create_app(service), host=options.server.host,
                            port=options.server.port, log_level=options.log_level,
                            timeout_graceful_shutdown=int(options.server.drain_timeout_s),
                            lifespan="on")
    with _signals_end_quietly():
        uvicorn.Server(config).run()
    return 0 if service.lifecycle.drained_cleanly else 1


class _SignalledStop(Exception):
    """uvicorn, after draining on SIGINT/SIGTERM, raises the signal again for the handler that
    was there before it: this one, so the exit status says how the drain went (not 130/143)."""


@contextlib.contextmanager
def _signals_end_quietly() -> Iterator[None]:
    def stop(signum: int, frame: object) -> None:
        raise _SignalledStop(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except _SignalledStop:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _is_hstu_run(run: Path) -> bool:
    """Whether ``run`` holds an HSTU training run (a run of neither kind is refused when it
    loads, ``train.stage_runs.stage_run_kind``)."""
    from relaygr.train.stage_runs import StageRunKind, stage_run_kind
    try:
        return stage_run_kind(run) is StageRunKind.HSTU
    except ConfigError:
        return False
