"""How much of a pair's held-out items the user's partner-domain items point at (docs/retrieval.md).

    PYTHONPATH=src python scripts/retrieval_cross_listed.py RUN [RUN ...] [--seed 0]

For each domain ``d`` of each run (partner ``p``), from the seed's training rows: how many items of
``d`` have an item of ``p`` bought by exactly the same users (at least two: a product listed in
both catalogues looks like this), and how many by mostly the same (Jaccard >= 0.5); then, over the
validation rows (the test rows stay unread), the share whose held-out item shares a training user
with one of the user's own ``p`` items ("linked"), with Jaccard >= 0.5 ("twin"), and HR@10 of the
run's model, of item-CF and of popularity on the linked rows and on the rest.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from relaygr.retrieval.checkpoint import load_seed, read_run_info
from relaygr.retrieval.evaluate import ItemCFScorer, PopularityScorer, VectorScorer, sampled_ranks


def _rows(edges: np.ndarray, num_users: int, num_items: int) -> sp.csr_matrix:
    r = sp.csr_matrix((np.ones(len(edges), np.float32), (edges[:, 0], edges[:, 1])),
                      shape=(num_users, num_items))
    r.data[:] = 1.0
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run in args.runs:
        info = read_run_info(run)
        if len(info.domains) != 2:
            raise SystemExit(f"{run}: a pair run is needed")
        trained = load_seed(run, info, args.seed)
        splits, model = trained.splits, trained.model
        rows = {d: _rows(s.train, info.num_users, s.num_items) for d, s in splits.items()}
        scorers = {
            "model": VectorScorer({d: model.user_vectors(d) for d in splits},
                                  {d: model.item_vectors(d) for d in splits}),
            "itemcf": ItemCFScorer.of({d: s.train for d, s in splits.items()},
                                      {d: s.num_items for d, s in splits.items()},
                                      info.num_users),
            "popularity": PopularityScorer.of({d: s.train for d, s in splits.items()},
                                              {d: s.num_items for d, s in splits.items()}),
        }
        for d, p in (info.domains, info.domains[::-1]):
            x, y = rows[d], rows[p]
            deg_x = np.asarray(x.sum(axis=0)).ravel()
            deg_y = np.asarray(y.sum(axis=0)).ravel()
            co = (y.T @ x).tocoo()                      # (I_p, I_d) shared users
            jaccard = co.data / (deg_y[co.row] + deg_x[co.col] - co.data)
            same = np.unique(co.col[(jaccard >= 1.0) & (co.data >= 2)])
            mostly = np.unique(co.col[(jaccard >= 0.5) & (co.data >= 2)])
            valid = splits[d].valid
            co_csc = co.tocsc()
            linked = np.zeros(len(valid), bool)
            twin = np.zeros(len(valid), bool)
            for r, (u, i) in enumerate(valid):
                mine = y.indices[y.indptr[u]:y.indptr[u + 1]]
                shared = co_csc[:, i].toarray().ravel()[mine]
                linked[r] = shared.sum() > 0
                if linked[r]:
                    jac = shared / (deg_y[mine] + deg_x[i] - shared)
                    twin[r] = jac.max() >= 0.5
            print(f"{run.name} seed {args.seed} {d} (partner {p}): {len(same)} of "
                  f"{int((deg_x >= 2).sum())} items with >= 2 users have a {p} item with the same "
                  f"users, {len(mostly)} one with Jaccard >= 0.5; validation rows {len(valid)}: "
                  f"linked {linked.mean():.3f}, twin {twin.mean():.3f}")
            for name, scorer in scorers.items():
                hit = sampled_ranks(scorer, d, valid, splits[d].valid_negatives) < 10
                print(f"    HR@10 {name:>10}: all {hit.mean():.3f} | linked "
                      f"{hit[linked].mean():.3f} | not linked {hit[~linked].mean():.3f} | twin "
                      f"{hit[twin].mean():.3f}")


if __name__ == "__main__":
    main()
