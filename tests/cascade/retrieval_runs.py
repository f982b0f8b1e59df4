"""A tiny MovieLens-layout log and a retrieval run trained on it in seconds (``relaygr
train-retrieval``, the package's own trainer), with an exact brute-force top-K to check it by."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from relaygr.cli.main import main
from relaygr.retrieval import RetrievalModel
from relaygr.retrieval.checkpoint import load_seed, read_run_info
from tests.tolerance import reorder_tolerance

# The dataset's movie ids: sparse, so a dense id mistaken for one names another item.
MOVIES = np.asarray([10 + 3 * j for j in range(300)], dtype=np.int64)
USERS = np.arange(1, 41, dtype=np.int64)


def write_ratings(folder: Path, per_user: int = 14, seed: int = 0) -> Path:
    """``folder/ratings_ordered.csv.gz``: user ``u`` rates movies of block ``u % 5`` (a fifth of
    the catalogue), in ``seq_pos`` order, every event timed."""
    rng = np.random.default_rng(seed)
    block = len(MOVIES) // 5
    rows = ["user_id,movie_id,rating,timestamp,seq_pos"]
    for user in USERS.tolist():
        chosen = (user % 5) * block + rng.choice(block, size=per_user, replace=False)
        for pos, j in enumerate(chosen.tolist()):
            rows.append(f"{user},{MOVIES[j]},4,{1_000_000 + 60 * pos},{pos}")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ratings_ordered.csv.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(rows) + "\n")
    return path


def train_run(data_dir: Path, out: Path) -> Path:
    """A single-domain GraphSAGE run on ``data_dir``'s ratings (two epochs, dim 8)."""
    assert main(["train-retrieval", "--dataset", "ml-1m", "--data-dir", str(data_dir),
                 "--out", str(out), "--preset", "single", "--split", "cvgae",
                 "--set", "dim=8", "--set", "max_epochs=2", "--set", "batch_size=128",
                 "--set", "num_negatives=32", "--no-progress"]) == 0
    return out


def load_run(run: Path) -> tuple[RetrievalModel, str, np.ndarray, np.ndarray]:
    """The run's model, its domain, and the dataset's ids of its users and items."""
    info = read_run_info(run)
    with np.load(run / "catalogue.npz") as z:
        users, items = z["users"], z[f"items/{info.domains[0]}"]
    return load_seed(run, info, info.seeds[0]).model, info.domains[0], users, items


@dataclass(frozen=True)
class BruteForce:
    """Every item both know, best first, as ranker ids with their exact scores, and how far two
    float32 summation orders of one score can differ (``tests/tolerance.py``)."""

    ids: np.ndarray
    scores: np.ndarray
    tol: float

    def top(self, k: int) -> np.ndarray:
        return self.ids[:k]

    def check(self, got: np.ndarray, k: int) -> None:
        """``got`` is the exact top ``k``: the same ids in the same order wherever the scores
        are further apart than rounding, and never an item outside the shared catalogue."""
        assert len(got) == min(k, len(self.ids)) and len(set(got.tolist())) == len(got)
        score = dict(zip(self.ids.tolist(), self.scores.tolist(), strict=True))
        assert set(got.tolist()) <= set(score)
        got_scores = np.asarray([score[i] for i in got.tolist()])
        np.testing.assert_allclose(got_scores, self.scores[:len(got)], rtol=0, atol=self.tol)
        apart = np.ones(len(got), dtype=bool)   # no other score within tol of this one
        gaps = np.abs(np.diff(self.scores[:len(got) + 1])) > self.tol
        apart &= gaps[:len(got)] & np.r_[True, gaps[:len(got) - 1]]
        assert (got[apart] == self.ids[:len(got)][apart]).all()


def brute_force(run: Path, ranker_movies: np.ndarray, history: np.ndarray,
                user_id: int | None, recent_events: int, recency: float = 1.0) -> BruteForce:
    """The exact scores of the run's vectors over the items both it and the ranker know (dense
    ranker ids: ``ranker_movies[i]`` is id ``i + 1``): the user vector from the known items
    among ``history`` (ranker ids), the latest ``recent_events`` of them weighted by
    ``recency`` (``RetrievalModel.user_vector``), its id embedding if trained."""
    model, domain, users, items = load_run(run)
    run_of = {int(m): j for j, m in enumerate(items.tolist())}
    ranker_of = {int(m): i + 1 for i, m in enumerate(ranker_movies.tolist())}
    recent = [run_of[m] for m in ranker_movies[history - 1].tolist()
              if m in run_of][-recent_events:]
    user = None if user_id is None or user_id not in users else \
        int(np.flatnonzero(users == user_id)[0])
    vectors = model.item_vectors(domain)
    query = model.user_vector(domain, recent, user, recency=recency)
    scores = vectors.astype(np.float64) @ query.astype(np.float64)
    both = np.asarray([j for j, m in enumerate(items.tolist()) if m in ranker_of])
    order = both[np.argsort(-scores[both], kind="stable")]
    terms = np.abs(vectors * query).sum(axis=1).max()
    return BruteForce(np.asarray([ranker_of[int(items[j])] for j in order]), scores[order],
                      reorder_tolerance(vectors.shape[1], float(terms)))
