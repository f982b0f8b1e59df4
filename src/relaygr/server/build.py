"""Building what a server serves: the model, the users' histories, the cost model, the service.

``load_model`` builds the model of a ``ModelSource``: a trained checkpoint through the training
package's loader when ``checkpoint`` is set, else a named size with seeded random weights (the
same seed gives bit-identical weights in every process; ``model_digest`` checks that). The
histories are a dataset's real users (with a checkpoint: the data it was trained on,
``server.served_data``), else seeded synthetic users over the model's catalogue; either way
timed exactly when the served model was trained with time (but a dataset's untimed users of a
run that trained them without time, ``TrainConfig.time_where_known``, stay untimed). A history
longer than the model's window is loaded as its newest window, cut where the window would start
(``cascade.window``: a block boundary counted from the first event), so the windows it reads as
visits append are those of the whole history; visits append past ``max_seq_len`` freely (the
window slides). With ``ModelSource.history_store`` the histories live in that shared Redis store
(``cascade.redis_store``), where start-up adds only the users it does not hold yet. The latency
cost model (the trigger's predictions) is loaded from a file or fitted by timing the model at
start-up. A trained run, when given, serves the cascade's retrieval stage (``load_retrieval``):
a retrieval run's towers, or another HSTU run's retrieval head.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.instances import build_instance
from relaygr.cascade.proposals import RetrievalStage
from relaygr.cascade.redis_store import RedisHistoryStore
from relaygr.cascade.store import HistoryStore, InMemoryHistoryStore, SyntheticHistories
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.window import HistoryWindow
from relaygr.engine.hostmem import release_free_memory
from relaygr.errors import CatalogueMismatchError, ConfigError
from relaygr.model import HSTU, config_for_size
from relaygr.relay.costmodel import LatencyCostModel
from relaygr.relay.measure import fit_on_model
from relaygr.server.backend import EmbeddedBackend
from relaygr.server.catalog import ItemCatalog, read_titles
from relaygr.server.config import ModelInfo, ModelSource, ServerConfig
from relaygr.server.served_data import dataset_store, recorded_dataset, served_dataset
from relaygr.server.service import RelayService

if TYPE_CHECKING:
    from relaygr.data import IdMap


def load_model(source: ModelSource, device: str = "cpu") -> HSTU:
    """The served model, in eval mode on ``device`` (see the module docstring)."""
    if source.checkpoint is not None:
        return _load_checkpoint(source.checkpoint, device)
    torch.manual_seed(source.seed)
    model = HSTU(config_for_size(source.size, source.num_items, source.max_seq_len))
    return model.to(device).eval()


def _load_checkpoint(path: Path, device: str) -> HSTU:
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} is not a directory")
    from relaygr.train import load_checkpoint  # only a server of a trained run needs it
    return load_checkpoint(path, device=device)


def load_store(source: ModelSource, model: HSTU, window: HistoryWindow,
               log: Callable[[str], None] = lambda _: None) -> HistoryStore:
    """The served users (see the module docstring), cut to ``window``: in memory, with the
    appends recorded at ``source.events`` replayed and every later one recorded there; or, with
    ``source.history_store``, in that shared store, where only the users it does not hold yet
    are added (a user it holds keeps its history, appends included: a second server process, or
    a restarted one, adds nothing twice)."""
    store = _base_store(source, model, window)
    if source.history_store is not None:
        shared = RedisHistoryStore.connect(source.history_store, model.cfg.num_items)
        try:
            added = shared.add_absent({user: (history.items, history.timestamps)
                                       for user, history in ((u, store.get(u)) for u in store)})
        except BaseException:
            shared.close()
            raise
        log(f"history store {source.history_store}: {added} of the {len(store)} users added, "
            f"{len(shared)} held")
        return shared
    if source.events is not None:
        replayed = store.persist_to(source.events, adopt=source.events_adopt)
        log(f"events: {replayed} appends replayed from {source.events}; new ones kept there")
    return store


def served_timed(source: ModelSource) -> bool:
    """Whether the served model reads time (its time-bucket bias): a checkpoint's when its run
    trained with timestamps; seeded random weights always (their synthetic users are timed).
    Every user served is timed exactly when this holds, those the API adds included, but a
    dataset's untimed users of a ``TrainConfig.time_where_known`` run (``dataset_store``)."""
    if source.checkpoint is None:
        return True
    from relaygr.train import read_run_config
    return read_run_config(source.checkpoint).train.use_timestamps


def _base_store(source: ModelSource, model: HSTU, window: HistoryWindow) -> InMemoryHistoryStore:
    timed = served_timed(source)
    dataset = served_dataset(source)
    if dataset is not None:
        return dataset_store(dataset, window, model.cfg.num_items, timed)
    max_events = min(source.max_events, model.cfg.max_seq_len)   # one window at most
    return InMemoryHistoryStore.synthetic(SyntheticHistories(
        num_users=source.num_users, num_items=model.cfg.num_items,
        min_events=min(source.min_events, max_events), max_events=max_events,
        seed=source.seed, timed=timed))


def load_cost_model(path: Path | None, model: HSTU, device: str) -> LatencyCostModel:
    """From ``path`` (a saved cost model or a ``relaygr profile`` JSON), else fitted now."""
    if path is None:
        return fit_on_model(model, device)
    try:
        return LatencyCostModel.load(path)
    except ConfigError:
        return LatencyCostModel.from_profile_json(path)


def model_info(source: ModelSource, model: HSTU) -> ModelInfo:
    """The served model's name (its run directory's, or the named size's), the package
    version, and the weights' digest."""
    from relaygr import __version__
    from relaygr.model.digest import model_digest

    name = source.checkpoint.name if source.checkpoint is not None else f"hstu-{source.size}"
    return ModelInfo(name, __version__, model_digest(model))


def load_catalog(source: ModelSource, model: HSTU) -> ItemCatalog:
    """The API's item ids for ``source``: the dataset's own (the checkpoint's id map), with
    titles where its data has them; a model without an id map of integer ids speaks dense ids."""
    if source.checkpoint is None:
        return ItemCatalog.identity(model.cfg.num_items)
    from relaygr.data import IdMap
    from relaygr.train.checkpoint import ID_MAP_FILE

    id_map = IdMap.load(source.checkpoint / ID_MAP_FILE)
    if not all(isinstance(i, int) for i in id_map.items):     # the API's ids are integers
        return ItemCatalog.identity(model.cfg.num_items)
    data_dir = source.data_dir
    if data_dir is None and not source.synthetic_users:
        data_dir = recorded_dataset(source).data_dir
    titles = read_titles(data_dir) if data_dir is not None else {}
    return ItemCatalog(id_map, model.cfg.num_items, titles)


def load_retrieval(source: ModelSource, system: SystemConfig, model: HSTU,
                   log: Callable[[str], None] = lambda _: None,
                   device: str | None = None) -> RetrievalStage | None:
    """The retrieval stage of ``source.retrieval_run`` as served (None without one), by the
    run's kind (``train.stage_runs.stage_run_kind``; ``ConfigError`` for a directory of neither
    kind): a retrieval run, its ids mapped through the checkpoint's id map
    (``CatalogueMismatchError`` when they cannot be), beside ``model``'s item embeddings at
    ``system.stages.retrieval_run_share`` and the item-to-item channel of its training
    interactions at ``retrieval_item_cf_rest_share`` of the rest
    (``trained_retrieval.beside_the_default``); or an
    HSTU run, over the checkpoint's very item ids and position-only
    (``train.stage_runs.load_stage_run``, ``ConfigError`` naming what differs), on ``device``
    (default: the ranking device, ``system.devices[0]``), alone."""
    if source.retrieval_run is None:
        return None
    from relaygr.data import IdMap
    from relaygr.train.checkpoint import ID_MAP_FILE
    from relaygr.train.stage_runs import StageRunKind, stage_run_kind

    assert source.checkpoint is not None      # ModelSource checks it
    id_map = IdMap.load(source.checkpoint / ID_MAP_FILE)
    if stage_run_kind(source.retrieval_run) is StageRunKind.HSTU:
        from relaygr.cascade.hstu_retrieval import HSTURunRetrieval
        head = HSTURunRetrieval.load(source.retrieval_run, id_map,
                                     device or system.devices[0])
        log(f"retrieval: {head.name}, top {system.stages.retrieval_k} of {head.num_items} items; "
            f"stage weight {system.stages.stage_weight:g}; stage delays "
            f"{system.stages.retrieval_delay_ms:g} + {system.stages.preprocess_delay_ms:g} ms")
        return head
    return _trained_retrieval(source, id_map, system, model, log)


def _trained_retrieval(source: ModelSource, id_map: IdMap, system: SystemConfig, model: HSTU,
                       log: Callable[[str], None]) -> RetrievalStage:
    from relaygr.cascade.trained_retrieval import (
        RankerCatalogue,
        TrainedRetrieval,
        beside_the_default,
    )
    from relaygr.train import read_run_config

    assert source.checkpoint is not None and source.retrieval_run is not None
    if not all(isinstance(i, int) for i in id_map.items):
        raise CatalogueMismatchError(f"{source.checkpoint} names its items by strings; a "
                                     "retrieval run's catalogue records integer ids")
    ranker = RankerCatalogue(read_run_config(source.checkpoint).dataset.name,
                             np.asarray(id_map.items), not source.synthetic_users)
    stage = TrainedRetrieval.load(source.retrieval_run, ranker, system.stages.retrieval_history,
                                  recency=system.stages.retrieval_recency)
    default, share, cf_share = system.stages.retrieval_shares
    beside = "alone" if share == 1 else (
        f"{share:.2g} of the list, beside the item embeddings ({default:.2g})"
        + (f" and its item-to-item channel ({cf_share:.2g}, "
           f"{system.stages.retrieval_item_cf_neighbours} neighbours an item)"
           if cf_share else ""))
    log(f"retrieval: {stage.name}, {stage.retriever.num_items} of the ranker's "
        f"{id_map.num_items} items indexed, {beside}; stage weight "
        f"{system.stages.stage_weight:g}; stage delays {system.stages.retrieval_delay_ms:g} + "
        f"{system.stages.preprocess_delay_ms:g} ms")
    return beside_the_default(stage, system.stages, model)


def sized_budgets(system: SystemConfig, model: HSTU, store: HistoryStore,
                  log: Callable[[str], None]) -> SystemConfig:
    """``system`` with per-instance cache budgets sized from ``model`` and ``store``'s users."""
    from relaygr.kvcache import KVLayout
    from relaygr.kvcache.sizing import available_host_bytes, size_budgets

    available = available_host_bytes()
    device = torch.device(system.devices[0])
    if device.type == "cuda":   # one cap for both tiers: the tighter of host and GPU memory
        available = min(available, torch.cuda.mem_get_info(device)[0])
    budgets = size_budgets(KVLayout.for_model(model.cfg, model.dtype),
                           [store.num_events(user) for user in store],
                           model.cfg.max_seq_len, system.instance.page_tokens,
                           system.num_instances, available)
    log(budgets.describe())
    return system.with_(instance={"device_budget_bytes": budgets.device_bytes,
                                  "host_budget_bytes": budgets.host_bytes})


def build_embedded(source: ModelSource, system: SystemConfig, server: ServerConfig,
                   cost_model: LatencyCostModel | Path | None = None,
                   instance_processes: bool = False, size_budgets: bool = False,
                   log: Callable[[str], None] = lambda _: None) -> RelayService:
    """A service over K instances (``system.num_instances``) on ``system.devices``: worker
    threads of this process, or with ``instance_processes`` a process each (each instance then
    computes under its own interpreter lock; ``engine.transport.processes``). The processes start
    with the service and end when it stops. ``size_budgets`` replaces the system's cache budgets
    with ones sized from the model and the users (``kvcache.sizing``); ``log`` hears how. Once the
    users are loaded, the memory that freed is handed back to the kernel
    (``engine.hostmem.release_free_memory``). The retrieval run is loaded before the users, so a
    run that does not fit is refused before the slow reading and before the event log is
    opened; a start that fails after that closes the store (the log and its lock let go)."""
    device = system.devices[0]
    log(f"loading the model ({source.checkpoint or source.size}) on {device}")
    model = load_model(source, device)
    retrieval = load_retrieval(source, system, model, log)
    log("loading the users")
    store = load_store(source, model, HistoryWindow.for_model(model.cfg, system), log)
    try:
        return _service(source, system, server, model, store, retrieval, cost_model,
                        instance_processes, size_budgets, log)
    except BaseException:
        store.close()
        raise


def _service(source: ModelSource, system: SystemConfig, server: ServerConfig, model: HSTU,
             store: HistoryStore, retrieval: RetrievalStage | None,
             cost_model: LatencyCostModel | Path | None, instance_processes: bool,
             size_budgets: bool, log: Callable[[str], None]) -> RelayService:
    """``build_embedded``'s service over the loaded ``model``, ``store`` and ``retrieval``; the
    instance processes, once started, are stopped again when it fails."""
    log(f"{len(store)} users; {model.cfg.num_layers} layers, dim {model.cfg.dim}, "
        f"{model.cfg.num_items} items, {sum(p.numel() for p in model.parameters())} weights")
    if size_budgets:
        system = sized_budgets(system, model, store, log)
    log(f"starting {system.num_instances} {system.mode} instances"
        f"{' in processes of their own' if instance_processes else ''}; fitting the cost model")
    device = system.devices[0]
    if not isinstance(cost_model, LatencyCostModel):
        cost_model = load_cost_model(cost_model, model, device)
    release_free_memory()   # what reading the dataset freed (see engine.hostmem)
    catalog, info, timed = load_catalog(source, model), model_info(source, model), \
        served_timed(source)
    if not instance_processes:
        return RelayService(EmbeddedBackend(RelaySystem(system, model, store, cost_model,
                                                        retrieval)),
                            server, catalog, info, timed=timed)
    from relaygr.engine.transport.processes import InstanceProcesses, threads_per_instance
    processes = InstanceProcesses.for_model(model, cost_model, system.num_instances,
                                            threads_per_instance(system.num_instances),
                                            build=build_instance)
    try:
        relay = RelaySystem(system, model, store, cost_model, retrieval,
                            instance_factory=processes.factory)
        return RelayService(EmbeddedBackend(relay, on_stop=processes.close), server, catalog,
                            info, timed=timed)
    except BaseException:
        processes.close()
        raise
