"""A tiny generated domain pair in the DisenCDR layout (``a_b/`` and ``b_a/``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def write_pair(root: Path, num_users: int = 40, items: tuple[int, int] = (1200, 1100),
               per_user: int = 6, seed: int = 0) -> Path:
    """Folders ``aa_bb`` and ``bb_aa`` under ``root``: every user has ``per_user`` training
    items and one test item in each domain (items of a user drawn from a user-specific block,
    so there is structure to learn)."""
    rng = np.random.default_rng(seed)
    for name, num_items in zip(("aa_bb", "bb_aa"), items, strict=True):
        folder = root / name
        folder.mkdir(parents=True)
        train, test = [], []
        for u in range(num_users):
            block = (u % 5) * (num_items // 5)
            chosen = block + rng.choice(num_items // 5, size=per_user + 1, replace=False)
            train += [f"{u}\t{i}\t1" for i in chosen[:-1]]
            test.append(f"{u}\t{chosen[-1]}\t1")
        (folder / "train.txt").write_text("\n".join(train) + "\n")
        (folder / "test.txt").write_text("\n".join(test[:-3]) + "\n")   # some users unseen
        (folder / "test_original.txt").write_text("\n".join(test) + "\n")
    return root


@pytest.fixture
def pair_dir(tmp_path: Path) -> Path:
    return write_pair(tmp_path / "data")
