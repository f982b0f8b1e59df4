"""Generated interaction data with a learnable sequential pattern, and a tiny training config."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from relaygr.data import UserSequences, load_sequences
from relaygr.train import TrainConfig

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


def cyclic_sequences(tmp_path: Path, num_users: int = 96) -> UserSequences:
    return load_sequences("ml-100k", write_cyclic_udata(tmp_path / "u.data", num_users))


TINY = TrainConfig(dim=16, num_layers=1, num_heads=2, max_seq_len=24, dropout=0.0,
                   batch_size=16, learning_rate=1e-2, num_negatives=16, rank_users=16,
                   rank_negatives=7, max_epochs=2, patience=5)
