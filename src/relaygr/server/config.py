"""Configuration of the HTTP server and of the model it serves: frozen, validated, no unknown keys.

``ServerConfig`` bounds what one request may carry and how the server sheds and drains;
``ModelSource`` says where the ranking model and the users' histories come from (a named size
with seeded random weights and synthetic users now, a trained checkpoint when one is given).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.redis_store import check_store_url
from relaygr.errors import ConfigError
from relaygr.settings import load, require_positive_ints

KiB = 1 << 10

# Hard caps that the OpenAPI schema itself states (the configured limits below are tighter):
# they keep every integer exact in JSON (2**53 - 1 is the largest integer every JSON parser
# holds exactly) and every list bounded before any check runs.
MAX_JSON_INT = (1 << 53) - 1
MAX_LIST_ITEMS = 1 << 16


@dataclass(frozen=True)
class ServerConfig:
    """Request limits, shedding and draining of one HTTP server."""

    host: str = "127.0.0.1"
    port: int = 8000                # 0: any free port
    # A ranking request with 4096 candidates and a 1024-event suffix is ~60 KiB of JSON; 1 MiB
    # leaves room for long event appends while refusing anything that is clearly not a request.
    max_body_bytes: int = 1024 * KiB
    # Candidates one /v1/rank request may carry (a fine-ranking stage gets hundreds).
    max_candidates: int = 4096
    # Events one /v1/events call or one visit's recent behaviours may carry.
    max_events_per_request: int = 4096
    # Requests admitted at once; past it the server answers 503 at the door (the relay system
    # sheds earlier, per instance queue; this bounds memory when every stage is slow).
    max_in_flight: int = 1024
    # Of them, one user's at most (its requests run one at a time, in order, so more only wait):
    # past it that user gets a 503, and the others keep their slots.
    max_in_flight_per_user: int = 16
    # Shutdown waits this long for in-flight requests before stopping the instances.
    drain_timeout_s: float = 30.0
    # Retry-After for 503s the server itself gives (draining, at the in-flight cap).
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"ServerConfig.port must be in 0..65535, got {self.port!r}")
        require_positive_ints(self, "max_body_bytes", "max_candidates", "max_events_per_request",
                              "max_in_flight", "max_in_flight_per_user")
        if self.max_candidates > MAX_LIST_ITEMS or self.max_events_per_request > MAX_LIST_ITEMS:
            raise ConfigError(f"ServerConfig list limits must be <= {MAX_LIST_ITEMS}")
        if not self.drain_timeout_s >= 0 or not self.retry_after_s > 0:
            raise ConfigError("ServerConfig.drain_timeout_s must be >= 0, retry_after_s > 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerConfig:
        return load(cls, data)


@dataclass(frozen=True)
class ModelSource:
    """The served model and users: a checkpoint directory, or a named size with seeded random
    weights over ``num_items`` items and ``num_users`` synthetic users.

    Every process that builds from the same source gets bit-identical weights (the seed fixes
    them), which is what lets Ray replicas and the ingress agree on one model.
    """

    size: str = "small"
    num_items: int = 10_000
    max_seq_len: int = 4096
    checkpoint: Path | None = None
    num_users: int = 1000
    # Synthetic history lengths (log-uniform), at most one window (visits slide it further).
    min_events: int = 32
    max_events: int = 2048
    seed: int = 0
    # Real users instead of synthetic ones: a dataset relaygr.data reads (``--dataset``,
    # ``--data-dir``), mapped through the checkpoint's id map; needs ``checkpoint``. Without
    # them a checkpoint serves the users of the data its run directory records.
    dataset: str | None = None
    data_dir: Path | None = None
    # A checkpoint with synthetic users instead (load tests): never chosen silently.
    synthetic_users: bool = False
    # Where appended events are kept across restarts (SQLite, cascade.eventlog); None: memory.
    events: Path | None = None
    # Take a log that records no user base (written by an older relaygr) as made on these
    # users (``InMemoryHistoryStore.persist_to``'s ``adopt``).
    events_adopt: bool = False
    # A shared history store (``redis://HOST:PORT[/DB]``, cascade.redis_store) instead of the
    # in-memory one: every server process that names it reads and appends the same histories.
    history_store: str | None = None
    # A trained run serving the retrieval stage instead of the model's item embeddings: a
    # retrieval run (``relaygr train-retrieval``; its ids mapped through the checkpoint's id
    # map) or an HSTU run (``relaygr train``; its retrieval head, over the checkpoint's ids).
    retrieval_run: Path | None = None

    def __post_init__(self) -> None:
        require_positive_ints(self, "num_items", "max_seq_len", "num_users", "min_events",
                              "max_events")
        if not self.min_events <= self.max_events <= self.max_seq_len:
            raise ConfigError("ModelSource needs min_events <= max_events <= max_seq_len")
        if (self.dataset is None) != (self.data_dir is None):
            raise ConfigError("ModelSource.dataset and data_dir go together")
        if self.dataset is not None and self.checkpoint is None:
            raise ConfigError("serving a dataset's users needs --checkpoint (its id map)")
        if self.synthetic_users and (self.checkpoint is None or self.dataset is not None):
            raise ConfigError("--synthetic-users is for a checkpoint served without --dataset")
        if self.history_store is not None:
            check_store_url(self.history_store)
            if self.events is not None:
                raise ConfigError("a shared history store keeps the appended events itself: "
                                  "pass --history-store or --events, not both")
        if self.retrieval_run is not None and self.checkpoint is None:
            raise ConfigError("--retrieval-run needs --checkpoint: the ranker's id map says "
                              "which items the retrieval run's ids are")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSource:
        return load(cls, data)


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``relaygr serve`` was asked for, validated."""

    model: ModelSource
    system: SystemConfig
    server: ServerConfig
    cost_model: Path | None
    ray: bool
    ray_address: str | None
    replicas: int
    replica_cpus: float | None      # None: a share that fits the Ray cluster
    log_level: str
    instance_processes: bool = False
    # Cache budgets sized from the model and its users (kvcache.sizing) unless the system
    # config gave them: True when neither budget was given.
    size_budgets: bool = False
    # Ray Serve ingress replicas (more than one need ``model.history_store``).
    ingress_replicas: int = 1

    def __post_init__(self) -> None:
        check_ingress_replicas(self.ingress_replicas, self.model)


@dataclass(frozen=True)
class ModelInfo:
    """What the service serves, as operators name it: KServe v2's model name and version, and
    the ``relaygr_model_info`` metric (with the weights' digest)."""

    name: str
    version: str
    digest: str


def check_ingress_replicas(ingress_replicas: int, model: ModelSource) -> None:
    """ConfigError unless ``ingress_replicas`` >= 1, and 1 without a shared history store (an
    in-memory store would hold each user's appends in whichever replica took them)."""
    if not isinstance(ingress_replicas, int) or ingress_replicas < 1:
        raise ConfigError(f"ingress replicas must be an int >= 1, got {ingress_replicas!r}")
    if ingress_replicas > 1 and model.history_store is None:
        raise ConfigError(f"{ingress_replicas} ingress replicas need a shared history store "
                          "(--history-store redis://HOST:PORT): each replica's in-memory store "
                          "would hold only the appends it took")
