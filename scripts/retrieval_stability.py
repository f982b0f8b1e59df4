"""Training stability of two retrieval runs (e.g. mixed CL vs SCCDR) across their seeds.

    PYTHONPATH=src python scripts/retrieval_stability.py --run mixed=RUN_A --run sccdr=RUN_B \
        --out docs/img/retrieval-stability-sport_cloth.png

Left: training loss (all terms, weighted) per epoch; right: validation NDCG@10 (mean over the
pair's domains) per epoch; one thin line per seed, the seeds' mean thick. Reads
``RUN/seed-<s>/metrics.jsonl`` only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from relaygr.retrieval.checkpoint import read_history, read_run_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", action="append", required=True, metavar="NAME=RUN")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    fig, (ax_loss, ax_valid) = plt.subplots(1, 2, figsize=(11, 4))
    for colour, spec in zip(("tab:red", "tab:blue", "tab:green", "tab:orange"), args.run,
                            strict=False):
        name, _, path = spec.partition("=")
        info = read_run_info(Path(path))
        curves = [read_history(Path(path), s) for s in info.seeds]
        for key, ax in (("loss", ax_loss), ("score", ax_valid)):
            series = [[h["loss"]["total"] if key == "loss" else h["score"] for h in c]
                      for c in curves]
            for s in series:
                ax.plot(range(1, len(s) + 1), s, color=colour, alpha=0.35, lw=0.8)
            n = min(len(s) for s in series)
            ax.plot(range(1, n + 1), np.mean([s[:n] for s in series], axis=0), color=colour,
                    lw=2, label=f"{name} ({len(series)} seeds)")
        title = info.pair
    ax_loss.set(xlabel="epoch", ylabel="training loss", title=f"{title}: training loss")
    ax_valid.set(xlabel="epoch", ylabel="validation NDCG@10 (mean of domains)",
                 title=f"{title}: validation")
    for ax in (ax_loss, ax_valid):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
