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
from relaygr.retrieval.evaluate import PopularityScorer, VectorScorer, sampled_ranks
from relaygr.retrieval.graph import BipartiteGraph, SharedUsers
from relaygr.retrieval.report import item_cf


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
        graphs = {d: BipartiteGraph(info.num_users, s.num_items, s.train)
                  for d, s in splits.items()}
        scorers = {
            "model": VectorScorer({d: model.user_vectors(d) for d in splits},
                                  {d: model.item_vectors(d) for d in splits}),
            "itemcf": item_cf(splits, info.num_users),
            "popularity": PopularityScorer.of({d: s.train for d, s in splits.items()},
                                              {d: s.num_items for d, s in splits.items()}),
        }
        for d, p in (info.domains, info.domains[::-1]):
            pairs = SharedUsers.of(graphs[d], graphs[p])
            both = pairs.shared >= 2
            same = np.unique(pairs.target_items[both & (pairs.jaccard >= 1.0)])
            mostly = np.unique(pairs.target_items[both & (pairs.jaccard >= 0.5)])
            deg_x = np.bincount(splits[d].train[:, 1], minlength=splits[d].num_items)
            y = graphs[p].interactions()
            co = sp.csc_matrix((pairs.shared, (pairs.partner_items, pairs.target_items)),
                               shape=(graphs[p].num_items, graphs[d].num_items))
            jac = sp.csc_matrix((pairs.jaccard, (pairs.partner_items, pairs.target_items)),
                                shape=co.shape)
            valid = splits[d].valid
            linked = np.zeros(len(valid), bool)
            twin = np.zeros(len(valid), bool)
            for r, (u, i) in enumerate(valid):
                mine = y.indices[y.indptr[u]:y.indptr[u + 1]]
                linked[r] = co[:, i].toarray().ravel()[mine].sum() > 0
                twin[r] = linked[r] and jac[:, i].toarray().ravel()[mine].max() >= 0.5
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
