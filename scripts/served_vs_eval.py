"""A served ``/v1/recommend`` answer against ``relaygr eval``'s cascade for the same user.

    PYTHONPATH=src python scripts/served_vs_eval.py --checkpoint B --retrieval A \
        --dataset ml-1m --data-dir ../shared/datasets/ml-1m --user 1 --k 200 --stage-weight 0.75 \
        ANSWER.json [ANSWER.json ...]

Each ``ANSWER.json`` is the body ``relaygr serve --checkpoint B --retrieval-run A --stage-weight
W`` returned for ``{"user_id": USER, "num_candidates": K}`` (no recent items). The script runs
eval's cascade (``train.evaluate.ranked_proposals`` and ``fuse``: what ``serving_ranks`` runs,
stage A's top K ranked by B against its prefill, fused with A's score) on the user's whole
history as the dataset holds it, the history the server serves (a history of at most
``max_seq_len`` events: longer ones are served from a block-aligned window) and prints whether
each answer holds the same items in the same order, and how far its scores are from eval's.
``tests/server/test_stage_fusion.py`` checks the same on generated data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from relaygr.data import load_sequences
from relaygr.data.split import EvalCases
from relaygr.train import load_trained
from relaygr.train.evaluate import CascadeSpec, fuse, prefilled_batches, ranked_proposals
from relaygr.train.stage_runs import load_stage_run
from relaygr.train.stages import CheckpointRetrieval


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="the ranker's run (B)")
    p.add_argument("--retrieval", type=Path, required=True, help="the stage's HSTU run (A)")
    p.add_argument("--dataset", default="ml-1m")
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--user", type=int, required=True, help="the dataset's user id")
    p.add_argument("--k", type=int, default=200)
    p.add_argument("--stage-weight", type=float, default=0.0)
    p.add_argument("answers", type=Path, nargs="+")
    args = p.parse_args()
    ranker = load_trained(args.checkpoint)
    seqs = load_sequences(args.dataset, args.data_dir, id_map=ranker.id_map)
    row = int(np.flatnonzero(seqs.user_ids == args.user)[0])
    events = len(seqs.sequence(row))
    if events > ranker.model.cfg.max_seq_len:
        print(f"note: user {args.user} has {events} events, more than max_seq_len "
              f"{ranker.model.cfg.max_seq_len}: the server reads a block-aligned window")
    cases = EvalCases(np.asarray([row]), np.asarray([events]), np.ones(1, dtype=np.int64))
    stage = CheckpointRetrieval(load_stage_run(args.retrieval, "cpu", ranker.id_map, None).model)
    [(rows, window, prefixes)] = prefilled_batches(ranker.model, seqs, cases,
                                                   ranker.model.cfg.max_seq_len,
                                                   ranker.uses_timestamps, 1, False)
    proposals, ranked = ranked_proposals(ranker.model, cases, rows, window, prefixes,
                                         CascadeSpec(stage, args.k, args.stage_weight))
    final = fuse(proposals, ranked, args.stage_weight)[0].float()
    ids, stage_scores = proposals.row(0)
    order = torch.argsort(final, descending=True, stable=True)
    items = np.asarray(ranker.id_map.items)[ids[order].numpy() - 1].tolist()
    want = {"scores": final[order], "ranker_scores": ranked[0].float()[order],
            "stage_scores": stage_scores[order]}
    print(f"user {args.user}: {events} events; eval's cascade (K {args.k}, w "
          f"{args.stage_weight:g}) top 5 {items[:5]}, final scores "
          f"{[round(x, 4) for x in want['scores'][:5].tolist()]}")
    for path in args.answers:
        answer = json.loads(path.read_text())
        gaps = {f: float((torch.tensor(answer[f]) - w).abs().max()) for f, w in want.items()}
        print(f"{path.name} (path {answer['path']}): same {len(items)} items in the same order: "
              f"{answer['candidates'] == items}; max |served - eval| "
              + ", ".join(f"{f} {g:.2e}" for f, g in gaps.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
