"""Retrieval run directories: one trained model per seed, with the exact split it was trained and
is evaluated on, and a record of the data it came from.

Layout of ``RUN``::

    run.json                  RunInfo: pair, data folders with sizes and file digests, split
                              kind, preset, config, seeds
    catalogue.npz             the source's id of every user (``users``) and of every item of
                              each domain (``items/<domain>``): how a served run's ids map to
                              another run's (``RunCatalogue``)
    seed-<s>/model.safetensors   weights of the best validation epoch
    seed-<s>/split/<domain>.npz  train / valid / test rows and the fixed-seed negatives
    seed-<s>/metrics.jsonl       one line per epoch: losses, validation HR/NDCG@10
    seed-<s>/result.json         best epoch, best validation score, training time, stop reason

Only safetensors, JSON and npz (no pickles). Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from relaygr.errors import CheckpointError, ConfigError
from relaygr.files import write_atomic
from relaygr.retrieval.config import SCCDRConfig
from relaygr.retrieval.data import DomainPair
from relaygr.retrieval.graph import BipartiteGraph
from relaygr.retrieval.model import RetrievalModel
from relaygr.retrieval.splits import DomainSplit, SplitKind
from relaygr.retrieval.trainer import TrainResult, held_out_rows
from relaygr.settings import load

RUN_FORMAT = "relaygr-retrieval-run/1"


@dataclass(frozen=True)
class RunInfo:
    """What ``run.json`` records (see the module doc)."""

    pair: str
    domains: tuple[str, ...]     # target first
    num_users: int
    split: SplitKind
    preset: str
    config: SCCDRConfig
    seeds: tuple[int, ...]
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"format": RUN_FORMAT, "pair": self.pair, "domains": list(self.domains),
                "num_users": self.num_users, "split": self.split.value, "preset": self.preset,
                "config": self.config.to_dict(), "seeds": list(self.seeds), "data": self.data}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunInfo:
        if not isinstance(d, dict) or d.get("format") != RUN_FORMAT:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise CheckpointError(f"not a retrieval run (format {found!r})")
        try:
            return load(cls, {k: v for k, v in d.items() if k != "format"})
        except ConfigError as exc:
            raise CheckpointError(f"invalid run.json: {exc}") from None


@dataclass(frozen=True)
class TrainedRetrieval:
    """One seed's model (eval mode, best epoch) and its splits by domain."""

    model: RetrievalModel
    splits: dict[str, DomainSplit]
    seed: int


RUN_INFO_FILE = "run.json"


def seed_dir(run_dir: Path, seed: int) -> Path:
    return Path(run_dir) / f"seed-{seed}"


def write_run_info(run_dir: Path, info: RunInfo) -> None:
    write_atomic(Path(run_dir) / RUN_INFO_FILE,
            lambda p: p.write_text(json.dumps(info.to_dict(), indent=2)))


def seed_finished(run_dir: Path, seed: int) -> bool:
    """Whether seed ``seed`` of the run finished training (its ``result.json``, written last)."""
    return (seed_dir(run_dir, seed) / "result.json").is_file()


def finished_seeds(run_dir: Path, info: RunInfo | None = None) -> tuple[int, ...]:
    """The seeds of the run's ``run.json`` (``info``, read when not given) that finished
    training: a seed an interrupted command listed without finishing it may be trained again."""
    info = read_run_info(run_dir) if info is None else info
    return tuple(s for s in info.seeds if seed_finished(run_dir, s))


def with_added_seeds(run_dir: Path, new: RunInfo) -> RunInfo:
    """The run at ``run_dir`` with ``new``'s seeds appended: ``new`` must record the same pair,
    split, preset, config and data (file digests) as its ``run.json``, and none of its finished
    seeds; ``CheckpointError`` otherwise. The run's report then covers the old and the new
    seeds."""
    old = read_run_info(run_dir)
    a, b = old.to_dict(), json.loads(json.dumps(new.to_dict()))   # as run.json would hold it
    # the same files named by another path (relative, a link, a moved copy) are the same data:
    # the digests and counts decide, not where the files were read from
    a["data"], b["data"] = _data_identity(a["data"]), _data_identity(b["data"])
    differ = sorted(k for k in a if k != "seeds" and a[k] != b[k])
    if differ:
        was, now = a["config"], b["config"]
        fields = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
        named = "" if not fields else \
            " (" + ", ".join(f"{k}: {was.get(k)!r} there" for k in fields) + ")"
        raise CheckpointError(f"{run_dir} records another {', '.join(differ)} than this "
                              f"training{named}; train into a new run directory, or match "
                              "it with --set")
    held = finished_seeds(run_dir, old)
    again = sorted(set(held) & set(new.seeds))
    if again:
        raise CheckpointError(f"{run_dir} already holds seed(s) {again}")
    return replace(new, seeds=held + new.seeds)


def _data_identity(data: dict[str, Any]) -> dict[str, Any]:
    """A run's data record without the paths it was read from."""
    out = {k: v for k, v in data.items() if k != "data_dir"}
    if isinstance(out.get("domains"), list):
        out["domains"] = [{k: v for k, v in d.items() if k != "folder"}
                          if isinstance(d, dict) else d for d in out["domains"]]
    return out


def read_run_info(run_dir: Path) -> RunInfo:
    path = Path(run_dir) / RUN_INFO_FILE
    if not path.is_file():
        raise CheckpointError(f"{run_dir} is not a retrieval run (no {RUN_INFO_FILE})")
    try:
        return RunInfo.from_dict(json.loads(path.read_text()))
    except ValueError as exc:
        raise CheckpointError(f"cannot parse {path}: {exc}") from None


@dataclass(frozen=True)
class RunCatalogue:
    """The source's ids of a run's users and of each domain's items (index = the run's id)."""

    users: np.ndarray
    items: dict[str, np.ndarray]


CATALOGUE_FILE = "catalogue.npz"


def save_catalogue(run_dir: Path, pair: DomainPair, domains: tuple[str, ...]) -> None:
    arrays: dict[str, Any] = {"users": pair.user_catalogue()}
    arrays.update({f"items/{d.name}": d.item_catalogue() for d in pair.domains
                   if d.name in domains})

    def write(path: Path) -> None:
        with path.open("wb") as fh:       # a file object: numpy adds no ".npz" to the name
            np.savez_compressed(fh, **arrays)

    write_atomic(Path(run_dir) / CATALOGUE_FILE, write)


def load_catalogue(run_dir: Path, info: RunInfo) -> RunCatalogue:
    """``CheckpointError`` when the run has none (trained before runs recorded it: retrain)."""
    path = Path(run_dir) / CATALOGUE_FILE
    if not path.is_file():
        raise CheckpointError(f"{run_dir} records no {CATALOGUE_FILE} (the source's ids of its "
                              "users and items); train it again to serve it")
    with np.load(path) as z:
        missing = [d for d in info.domains if f"items/{d}" not in z.files]
        if missing or "users" not in z.files:
            raise CheckpointError(f"{path} lacks the users or the items of {missing}")
        return RunCatalogue(z["users"].astype(np.int64),
                            {d: z[f"items/{d}"].astype(np.int64) for d in info.domains})


def save_splits(run_dir: Path, seed: int, splits: dict[str, DomainSplit]) -> None:
    for name, split in splits.items():
        path = seed_dir(run_dir, seed) / "split" / f"{name}.npz"
        write_atomic(path, split.save)


def load_splits(run_dir: Path, seed: int, domains: tuple[str, ...]) -> dict[str, DomainSplit]:
    return {d: DomainSplit.load(seed_dir(run_dir, seed) / "split" / f"{d}.npz", d)
            for d in domains}


def save_result(run_dir: Path, seed: int, result: TrainResult) -> None:
    out = seed_dir(run_dir, seed)
    # clones: a table the towers share (share_user_embedding) is one tensor under two keys,
    # which safetensors refuses to write as such
    state = {k: v.detach().cpu().clone() for k, v in result.model.state_dict().items()}
    write_atomic(out / "model.safetensors", lambda p: save_file(state, str(p)))
    lines = "".join(json.dumps(h) + "\n" for h in result.history)
    write_atomic(out / "metrics.jsonl", lambda p: p.write_text(lines))
    summary = {"best_epoch": result.best_epoch, "best_valid_ndcg@10": result.best_score,
               "elapsed_s": result.elapsed_s, "stopped": result.stopped}
    write_atomic(out / "result.json", lambda p: p.write_text(json.dumps(summary, indent=2)))


def load_seed(run_dir: Path, info: RunInfo, seed: int) -> TrainedRetrieval:
    """Rebuild seed ``seed``'s model from its split's training graph and load its weights;
    ``CheckpointError`` for a seed that did not finish training."""
    if not seed_finished(run_dir, seed):
        raise CheckpointError(f"seed {seed} of {run_dir} did not finish training (no "
                              f"result.json); train it again with --add-seeds --seeds {seed}")
    splits = load_splits(run_dir, seed, info.domains)
    graphs = {d: BipartiteGraph(info.num_users, s.num_items, s.train) for d, s in splits.items()}
    model = RetrievalModel(graphs, info.config, held_out_rows(splits))
    path = seed_dir(run_dir, seed) / "model.safetensors"
    try:
        model.load_state_dict(load_file(str(path)), strict=True)
    except (OSError, SafetensorError, RuntimeError) as exc:
        raise CheckpointError(f"cannot load {path}: {exc}") from None
    model.eval()
    return TrainedRetrieval(model, splits, seed)


def read_result(run_dir: Path, seed: int) -> dict[str, Any]:
    path = seed_dir(run_dir, seed) / "result.json"
    if not path.is_file():
        raise CheckpointError(f"seed {seed} of {run_dir} has not finished (no result.json)")
    out: dict[str, Any] = json.loads(path.read_text())
    return out


def read_history(run_dir: Path, seed: int) -> list[dict[str, Any]]:
    path = seed_dir(run_dir, seed) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


