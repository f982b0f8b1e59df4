"""Markdown tables from ``relaygr eval-retrieval`` reports (docs/retrieval.md).

    PYTHONPATH=src python scripts/retrieval_tables.py REPORT.json [REPORT.json ...]

One table per report: a row per model (the run's preset, the baselines, then the fused
channels of reports that have them), a column per domain and metric, ``mean ± std`` over the
report's seeds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(report: dict) -> str:
    rows = [(f"{report['model_preset']} (model)", report["model"]),
            *report["baselines"].items(), *report.get("fused", {}).items()]
    domains = list(report["model"])
    metrics = [k for k in report["model"][domains[0]] if not k.endswith("_std")]
    head = ["model"] + [f"{d} {m.upper()}" for d in domains for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, values in rows:
        cells = [f"{values[d][m]:.4f} ± {values[d][m + '_std']:.4f}" for d in domains
                 for m in metrics]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    title = (f"**{report['pair']}**, protocol `{report['protocol']}`, seeds "
             f"{', '.join(map(str, report['seeds']))}")
    return title + "\n\n" + "\n".join(lines) + "\n"


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(table(json.loads(Path(path).read_text())))
