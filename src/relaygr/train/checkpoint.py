"""Run directories: the trained model (safetensors + JSON config + id map) and resumable state.

Layout of ``RUN_DIR``::

    config.json        RunConfig: model config, training config, dataset summary, seed
    model.safetensors  weights of the best validation epoch (what serving loads); written at
                       the first validation, so a run stopped before it holds none and
                       ``load_trained`` refuses it; after a ranking phase, with the phase's head
    schedule/best.safetensors  the best validation epoch's weights as the schedule left them,
                       the ranking phase's starting point (written beside model.safetensors
                       by a run with a phase; ``load_schedule_best``)
    id_map.json        original item id of every dense id (relaygr.data.IdMap)
    metrics.jsonl      one line per validation and per ranking-phase epoch (``metrics_log``)
    last/state.safetensors  weights, optimizer moments and RNG states after the schedule's last
                            epoch (a ranking phase changes none of them), and its progress (in
                            the file's metadata)
    last/progress.json      that progress again, for people and scripts: epoch counters, best
                            score, patience, elapsed time

Only safetensors and JSON: nothing is unpickled. Files are written to a temporary name and
renamed, so an interrupted save leaves the previous checkpoint intact. The resumable state is
one file (the progress rides in its metadata): a save interrupted between two renames cannot
pair one epoch's weights with another's counters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from relaygr.data.sequences import IdMap, UserSequences
from relaygr.errors import CheckpointError, ConfigError
from relaygr.files import write_atomic
from relaygr.model import HSTU, HSTUConfig
from relaygr.settings import load
from relaygr.train.config import TrainConfig

RUN_FORMAT = "relaygr-run/1"
CONFIG_FILE, MODEL_FILE, ID_MAP_FILE = "config.json", "model.safetensors", "id_map.json"
STATE_FILE, PROGRESS_FILE = "last/state.safetensors", "last/progress.json"
SCHEDULE_BEST_FILE = "schedule/best.safetensors"


@dataclass(frozen=True)
class DatasetInfo:
    """What a model was trained on (checked when its users are served, or it is evaluated on a
    dataset again): the format the data was read as, the file, its counts, the content
    fingerprint of its rows, and that of the user sequences built from them, each user's events
    in its order (``relaygr.data.fingerprint``: the same rows in another file order can order
    a user's events otherwise, hence another split and other histories)."""

    name: str
    source: str
    num_users: int
    num_items: int
    num_events: int
    # None: a run saved before runs recorded one; its data is then checked by the counts alone
    fingerprint: str | None = None
    # None: a run saved before runs recorded it; its data is then checked by the counts and the
    # rows' fingerprint alone, whatever order the file gives a user's events of one timestamp
    sequence_fingerprint: str | None = None

    @classmethod
    def of(cls, name: str, seqs: UserSequences) -> DatasetInfo:
        return cls(name, seqs.source, seqs.num_users, seqs.num_items, seqs.num_events,
                   seqs.fingerprint, seqs.sequence_fingerprint)


@dataclass(frozen=True)
class RunConfig:
    """Everything needed to rebuild a run's model and to know how it was trained."""

    model: HSTUConfig
    train: TrainConfig
    dataset: DatasetInfo
    seed: int
    preset: str
    # the run directory of the retrieval stage this ranker was trained against (its hard
    # negatives came from that stage's head); None: from the model's own retrieval head
    stage: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"format": RUN_FORMAT, "model": self.model.to_dict(),
                "train": self.train.to_dict(), "dataset": asdict(self.dataset),
                "seed": self.seed, "preset": self.preset, "stage": self.stage}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """The run config ``to_dict`` wrote, read by ``settings.load`` (unknown keys refused at
        any depth); ``CheckpointError`` saying why when it is not one."""
        if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise CheckpointError(f"not a relaygr run config (format {found!r})")
        fields_ = {k: v for k, v in data.items() if k != "format"}
        if isinstance(fields_.get("train"), dict) and "seed" in fields_:
            # runs saved before valid_seed chose their validation users with the run seed
            fields_["train"] = {"valid_seed": fields_["seed"], **fields_["train"]}
        try:
            return load(cls, fields_)
        except ConfigError as exc:
            raise CheckpointError(f"invalid run config: {exc}") from None


def _cpu_state(model: HSTU) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def write_run_config(run_dir: Path, run: RunConfig) -> None:
    write_atomic(Path(run_dir) / CONFIG_FILE,
                  lambda p: p.write_text(json.dumps(run.to_dict(), indent=2)))


def save_run_files(run_dir: Path, run: RunConfig, id_map: IdMap) -> None:
    """Write what a run is before it has weights: its config and id map (``train`` at its
    start, so that the run can be resumed)."""
    run_dir = Path(run_dir)
    if id_map.num_items != run.model.num_items:
        raise CheckpointError(f"id map has {id_map.num_items} items, model {run.model.num_items}")
    write_run_config(run_dir, run)
    write_atomic(run_dir / ID_MAP_FILE, id_map.save)


def save_model(run_dir: Path, model: HSTU, run: RunConfig, id_map: IdMap) -> None:
    """Write the servable part of a run: config, weights, id map."""
    if id_map.num_items != model.cfg.num_items:
        raise CheckpointError(f"id map has {id_map.num_items} items, model {model.cfg.num_items}")
    save_run_files(run_dir, run, id_map)
    write_atomic(Path(run_dir) / MODEL_FILE, lambda p: save_file(_cpu_state(model), str(p)))


def save_schedule_best(run_dir: Path, model: HSTU) -> None:
    """Write ``model`` as the schedule's best weights, where the ranking phase starts."""
    write_atomic(Path(run_dir) / SCHEDULE_BEST_FILE,
                  lambda p: save_file(_cpu_state(model), str(p)))


def load_schedule_best(run_dir: Path, model: HSTU) -> None:
    """Load the schedule's best weights into ``model``. A run saved before it wrote
    ``SCHEDULE_BEST_FILE`` gives ``MODEL_FILE`` instead: the schedule's best while its phase has
    not run, its layers with the phase's head after (the phase trains the head alone), until a
    new best epoch writes the file."""
    path = Path(run_dir) / SCHEDULE_BEST_FILE
    _load_weights(model, path if path.is_file() else Path(run_dir) / MODEL_FILE)


def has_weights(run_dir: Path) -> bool:
    """Whether the run has validated at least once (its best weights are written)."""
    return (Path(run_dir) / MODEL_FILE).is_file()


def _load_weights(model: HSTU, path: Path) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    weights = {k: v for k, v in tensors.items() if "/" not in k}
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path} does not fit the configured model: {exc}") from None
    return tensors


def read_run_config(run_dir: Path) -> RunConfig:
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{run_dir} is not a training run (no {CONFIG_FILE})")
    try:
        return RunConfig.from_dict(json.loads(path.read_text()))
    except ValueError as exc:
        raise CheckpointError(f"cannot parse {path}: {exc}") from None


@dataclass(frozen=True)
class TrainedModel:
    """A trained HSTU ready to serve (eval mode, on its device), with its id map.

    Feed it dense ids (``dense_items``); pass timestamps to ``prefill`` / ``rank`` exactly when
    ``uses_timestamps`` (the convention it was trained with), for a timed user (a run with
    ``time_where_known`` trained its untimed users without).
    """

    model: HSTU
    id_map: IdMap
    run: RunConfig

    @property
    def uses_timestamps(self) -> bool:
        return self.run.train.use_timestamps

    def dense_items(self, originals: np.ndarray | list[Any]) -> np.ndarray:
        """Dense ids of original item ids; an unknown id raises ``CheckpointError``."""
        dense = self.id_map.dense_ids(np.asarray(originals))
        if (dense == 0).any():
            unknown = np.asarray(originals)[dense == 0][0]
            raise CheckpointError(f"item {unknown!r} is not in this model's id map")
        return dense


def load_trained(run_dir: Path, device: torch.device | str = "cpu") -> TrainedModel:
    """Load ``RUN_DIR``'s best model and id map (see the module doc) for serving or evaluation."""
    run_dir = Path(run_dir)
    run = read_run_config(run_dir)
    id_map = IdMap.load(run_dir / ID_MAP_FILE)
    if id_map.num_items != run.model.num_items:
        raise CheckpointError(f"{run_dir}: id map has {id_map.num_items} items, config "
                              f"{run.model.num_items}")
    if not has_weights(run_dir):
        raise CheckpointError(f"{run_dir} holds no trained weights yet ({MODEL_FILE}: its "
                              "training stopped before the first validation); resume it with "
                              "relaygr train --resume")
    model = HSTU(run.model)
    _load_weights(model, run_dir / MODEL_FILE)
    return TrainedModel(model.to(device).eval(), id_map, run)


def load_checkpoint(run_dir: Path, device: torch.device | str = "cpu") -> HSTU:
    """Only the model of ``RUN_DIR`` (what ``relaygr serve --checkpoint`` loads)."""
    return load_trained(run_dir, device).model


@dataclass
class TrainProgress:
    """Mutable counters of a run, saved with every checkpoint."""

    epoch: int = 0               # epochs completed
    step: int = 0                # optimizer steps taken
    best_ndcg: float = -1.0      # best validation NDCG@10 so far (-1: none yet)
    best_epoch: int = 0
    evals_since_best: int = 0
    evals_since_decay: int = 0   # validations since the best score or the last lr decay
    lr_scale: float = 1.0        # current learning rate / TrainConfig.learning_rate
    elapsed_s: float = 0.0       # the schedule's wall time over all sessions of the run
    # the last epoch's wall time, the time budget's estimate of the next one (a resumed run
    # decides with it as the run did); None: saved before runs recorded it, the mean epoch's
    epoch_s: float | None = None
    stopped: str = ""            # why the run ended ("" while it may continue)
    rank_phase_done: bool = False  # the ranking phase after the schedule has run (rank_phase)
    rank_phase_s: float = 0.0    # that phase's wall time (0 while it has not run)
    history: list[dict[str, Any]] = field(default_factory=list)


def save_train_state(run_dir: Path, model: HSTU, optimizer: torch.optim.Optimizer,
                     progress: TrainProgress, sample_gen: torch.Generator) -> None:
    """Everything ``load_train_state`` needs to continue exactly where this epoch ended."""
    tensors = _cpu_state(model)
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            tensors[f"opt/{name}/{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    tensors["rng/cpu"] = torch.get_rng_state()
    tensors["rng/sample"] = sample_gen.get_state()
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda{i}"] = state
    run_dir = Path(run_dir)
    record = json.dumps(asdict(progress), indent=1)
    write_atomic(run_dir / STATE_FILE,
                  lambda p: save_file(tensors, str(p), metadata={_PROGRESS_KEY: record}))
    write_atomic(run_dir / PROGRESS_FILE, lambda p: p.write_text(record))


# The state file's metadata key for its progress record (``TrainProgress`` as JSON).
_PROGRESS_KEY = "relaygr.progress"


def has_train_state(run_dir: Path) -> bool:
    return (Path(run_dir) / STATE_FILE).is_file()


def load_train_state(run_dir: Path, model: HSTU, optimizer: torch.optim.Optimizer,
                     sample_gen: torch.Generator) -> TrainProgress:
    """Restore model, optimizer moments and RNG states; return the saved progress."""
    run_dir = Path(run_dir)
    if not has_train_state(run_dir):
        raise CheckpointError(f"{run_dir} has no resumable state ({STATE_FILE})")
    tensors = _load_weights(model, run_dir / STATE_FILE)
    device = model.device
    for name, param in model.named_parameters():
        prefix = f"opt/{name}/"
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if state:
            optimizer.state[param] = {k: (v if k == "step" else v.to(device))
                                      for k, v in state.items()}
    torch.set_rng_state(tensors["rng/cpu"])
    sample_gen.set_state(tensors["rng/sample"])
    if torch.cuda.is_available():
        cuda_states = [tensors[f"rng/cuda{i}"] for i in range(torch.cuda.device_count())
                       if f"rng/cuda{i}" in tensors]
        if cuda_states:
            torch.cuda.set_rng_state_all(cuda_states)
    source, record = _progress_record(run_dir)
    try:
        return load(TrainProgress, json.loads(record))
    except ValueError as exc:     # not JSON, or a ConfigError naming the bad field
        raise CheckpointError(f"cannot parse {source}: {exc}") from None


def _progress_record(run_dir: Path) -> tuple[str, str]:
    """Where the state's progress is read from, and its JSON: the state file's metadata (saved
    with the weights it describes), or ``PROGRESS_FILE`` for a state saved before it held one."""
    state = run_dir / STATE_FILE
    try:
        with safe_open(str(state), framework="pt") as f:
            metadata = f.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read {state}: {exc}") from None
    if _PROGRESS_KEY in metadata:
        return f"the progress in {state}", metadata[_PROGRESS_KEY]
    path = run_dir / PROGRESS_FILE
    try:
        return str(path), path.read_text()
    except OSError as exc:
        raise CheckpointError(f"{run_dir} has no progress for its state: {exc}") from None
