"""A run directory named as a cascade's retrieval stage: which kind of run it is, and the checks
an HSTU run must pass to propose items to another run's ranker.

One place for ``relaygr train --stage RUN``, ``relaygr eval --retrieval RUN`` and ``relaygr serve
--retrieval-run RUN``: the kind is read from the files the directory holds (an HSTU training run
writes ``config.json``, a ``relaygr train-retrieval`` run ``run.json``), and a directory that is
neither is refused with ``ConfigError``, as is an HSTU stage over other item ids or one that
reads timestamps (``load_stage_run``).

Where a choice is made on the ranker's validation users (``train --stage``: the hard negatives
and the ranking phase's head; ``eval --fit-stage-weight``: the weight), the stage must not have
trained on their targets: ``load_stage_run`` compares the two runs' validation settings, and
``check_stage_held_out`` measures the share on the data (the same settings on other data draw
other users).
"""

from __future__ import annotations

import enum
from pathlib import Path

import torch

from relaygr.data import TableSpec
from relaygr.data.sequences import IdMap, UserSequences
from relaygr.data.split import EvalCases
from relaygr.errors import ConfigError
from relaygr.retrieval.checkpoint import RUN_INFO_FILE
from relaygr.train.checkpoint import CONFIG_FILE, TrainedModel, load_trained
from relaygr.train.config import TrainConfig
from relaygr.train.run_data import HeldOutCheck, check_held_out


class StageRunKind(enum.Enum):
    """What a stage's run directory holds."""

    HSTU = "hstu"              # ``relaygr train``: its retrieval head proposes
    RETRIEVAL = "retrieval"    # ``relaygr train-retrieval``: its towers propose


def stage_run_kind(path: Path) -> StageRunKind:
    """The kind of run in ``path`` (module docstring); ``ConfigError`` when it is neither."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"stage run {path} is not a directory")
    if (path / RUN_INFO_FILE).is_file():
        return StageRunKind.RETRIEVAL
    if (path / CONFIG_FILE).is_file():
        return StageRunKind.HSTU
    raise ConfigError(f"{path} is neither an HSTU training run (no {CONFIG_FILE}) nor a "
                      f"retrieval run (no {RUN_INFO_FILE})")


def load_stage_run(path: Path, device: torch.device | str, id_map: IdMap,
                   held_out: TrainConfig | None) -> TrainedModel:
    """An HSTU run as a cascade's retrieval stage: over the same items (``id_map``, the
    ranker's), position-only, and, when ``held_out`` is given, holding out the same validation
    users as that config (else a choice made on them would be made on items the stage trained
    on). ``ConfigError`` naming what differs."""
    stage = load_trained(path, device)
    if stage.id_map != id_map:
        raise ConfigError(f"stage {path} numbers items differently from the ranker's data")
    if stage.uses_timestamps:
        raise ConfigError(f"stage {path} reads timestamps; a stage must be position-only")
    theirs = stage.run.train
    if held_out is not None and (theirs.valid_users, theirs.valid_seed) != (
            held_out.valid_users, held_out.valid_seed):
        raise ConfigError(f"stage {path} held out other validation users (valid_users "
                          f"{theirs.valid_users}, valid_seed {theirs.valid_seed}): a choice on "
                          "the validation users would be made on items the stage trained on")
    return stage


def check_stage_held_out(stage: TrainedModel, seqs: UserSequences, valid: EvalCases,
                         chosen: str, remedy: str, spec: TableSpec | None = None
                         ) -> HeldOutCheck:
    """The ranker's validation targets ``valid`` of ``seqs`` against what ``stage`` trained on
    (``run_data.check_held_out``, ``spec`` as the data was read): ``ConfigError`` when the stage
    trained on any, saying what would be ``chosen`` on them and the ``remedy``; the check
    otherwise, unmeasured (``share`` None) when the stage's data cannot be read, which the caller
    must say."""
    held = check_held_out(stage, seqs, valid, spec)
    if held.share:
        raise ConfigError(f"the stage trained on {held.share:.1%} of the validation targets "
                          f"{chosen} ({held.source}): {remedy}")
    return held
