"""Generated interaction data with a learnable sequential pattern, and a tiny training config."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from relaygr.data import UserSequences, load_sequences
from relaygr.model import HSTU
from relaygr.train import TrainConfig
from relaygr.train.checkpoint import DatasetInfo, RunConfig, save_model

NUM_ITEMS = 120


GROUPS = 6


def write_cyclic_udata(path: Path, num_users: int = 64, seed: int = 0) -> Path:
    """A ``u.data`` file with a learnable pattern popularity cannot see: user ``u`` stays in
    item group ``u % GROUPS`` (a sixth of the catalogue) and walks it in steps of +1, with 10%
    random jumps inside the group. The history tells the group (what a ranking head picks up
    first) and the last item tells the next one (what next-item retrieval picks up)."""
    rng = np.random.default_rng(seed)
    size = NUM_ITEMS // GROUPS
    lines = []
    for user in range(1, num_users + 1):
        base = (user % GROUPS) * size
        item = int(rng.integers(size))
        for step in range(int(rng.integers(8, 15))):
            jump = rng.random() < 0.1
            item = int(rng.integers(size)) if jump else (item + 1) % size
            lines.append(f"{user}\t{base + item + 1}\t5\t{1_000_000 + 60 * step}\n")
    path.write_text("".join(lines))
    return path


def write_truncated(full: Path, out_dir: Path, drop_user: Callable[[int], bool]) -> Path:
    """``out_dir/u.data``: the ``u.data`` lines of ``full`` (in time order per user) without the
    last two events of each user for whom ``drop_user(user)`` holds."""
    by_user: dict[int, list[str]] = {}
    for line in full.read_text().splitlines(keepends=True):
        by_user.setdefault(int(line.split("\t")[0]), []).append(line)
    kept = [line for user, own in by_user.items()
            for line in (own[:-2] if drop_user(user) else own)]
    out_dir.mkdir(parents=True)
    (out_dir / "u.data").write_text("".join(kept))
    return out_dir


def write_tied_udata(path: Path, num_users: int = 40, swapped: bool = False) -> Path:
    """``path``, a ``u.data`` file of ``write_cyclic_udata``'s log in which each user's last
    two events share their timestamp (as ``ratings.dat`` often has them), the earlier of the
    two first; ``swapped``: the same rows, those two lines of each user in the other order.
    Ties keep file order, so the two files give the same rows and other sequences: each user's
    last two items trade places (where they are two items)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_cyclic_udata(path, num_users)
    by_user: dict[str, list[list[str]]] = {}
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        by_user.setdefault(fields[0], []).append(fields)
    lines = []
    for rows in by_user.values():
        rows[-1][3] = rows[-2][3]
        if swapped:
            rows[-2], rows[-1] = rows[-1], rows[-2]
        lines += ["\t".join(fields) + "\n" for fields in rows]
    path.write_text("".join(lines))
    return path


# The position in a user's sequence whose time ``write_interactions`` can send back.
BACK_POSITION = 5
# 2023-11-14 in milliseconds: as seconds, past the API's 2^40.
MS_STAMP = 1_700_000_000_000


def write_interactions(path: Path, users: Sequence[object], events: int = 10,
                       back: object | None = None, milliseconds: object | None = None) -> Path:
    """``path``, a generic table (``user,item,timestamp,order``): ``events`` events a minute
    apart for each of ``users``, over 40 items, the users' rows one after another; user ``back``
    (one of ``users``) has its event at ``BACK_POSITION`` timed before its first while the
    order column keeps it there; user ``milliseconds`` has its times in milliseconds (its first
    ``MS_STAMP``). A row's line is 2 + its index (line 1 is the header)."""
    rows = ["user,item,timestamp,order"]
    for k, user in enumerate(users):
        for step in range(events):
            stamp = 999_000 if user == back and step == BACK_POSITION else 1_000_000 + 60 * step
            if user == milliseconds:
                stamp = MS_STAMP + 60_000 * step
            rows.append(f"{user},{(k * 7 + step) % 40 + 1},{stamp},{step}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")
    return path


def cyclic_sequences(tmp_path: Path, num_users: int = 96) -> UserSequences:
    return load_sequences("ml-100k", write_cyclic_udata(tmp_path / "u.data", num_users))


TINY = TrainConfig(dim=16, num_layers=1, num_heads=2, max_seq_len=24, dropout=0.0,
                   batch_size=16, learning_rate=1e-2, num_negatives=16, rank_users=16,
                   rank_negatives=7, max_epochs=2, patience=5)


def write_untrained_run(out: Path, seqs: UserSequences, config: TrainConfig = TINY,
                        seed: int = 0, dataset: str = "ml-100k") -> Path:
    """A run directory of an untrained model recording ``seqs`` (``seqs.source``, read as
    ``dataset``) as its training data and ``config`` as its training config: for what depends
    on a run's records, not its weights, data training refuses included."""
    torch.manual_seed(seed)
    model = HSTU(config.model_config(seqs.num_items)).eval()
    run = RunConfig(model.cfg, config, DatasetInfo.of(dataset, seqs), seed, "custom")
    save_model(out, model, run, seqs.id_map)
    return out
