"""The benchmark's entry point: ``run_benchmark(systems, config, out_dir) -> BenchReport``.

``systems`` maps a mode name (``baseline``, ``reactive``, ``relay``, ``relay-no-trigger``,
``relay-no-affinity``, ``relay-no-expander``, or any other) to a factory that builds a fresh
``RankingSystem`` from a ``SystemContext`` (the point's workload, the run clock). Modes are
measured in the order given, alternating point by point. Writes ``bench.json`` (or
``json_path``) and three PNG plots into ``out_dir`` and prints the console table; while it runs,
``points.jsonl`` there records each point and phase as it finishes (``relaygr.bench.journal``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console

from relaygr.bench.config import BenchConfig
from relaygr.bench.console import print_report
from relaygr.bench.hardware import matmul_peak_gflops
from relaygr.bench.journal import JOURNAL_NAME, Journal
from relaygr.bench.limit import LimitProbe
from relaygr.bench.operating import CostProbe
from relaygr.bench.plots import write_plots
from relaygr.bench.progress import NullProgress, Progress, RichProgress
from relaygr.bench.protocol import SystemFactory
from relaygr.bench.report import BenchReport, write_json
from relaygr.bench.suite import BenchSuite


def run_benchmark(systems: Mapping[str, SystemFactory], config: BenchConfig, out_dir: Path,
                  probe: LimitProbe | None = None, *, json_path: Path | None = None,
                  show_progress: bool = True, console: Console | None = None,
                  extra_systems: Mapping[str, SystemFactory] | None = None,
                  cost_probe: CostProbe | None = None) -> BenchReport:
    """Measure every mode in ``systems`` under ``config``; write and print the results.

    ``probe`` times the isolated cached ranking pass (the physical limit); without it the
    limit's isolated latency and overhead ratio are null. ``cost_probe`` times the baseline's
    full pass for the fixed-length throughput search's operating point
    (``relaygr.bench.operating``); without it that length is the baseline's sweep answer.
    ``extra_systems`` are measured only
    in the extra workload phases that name them (``config.workloads``). Raises
    ``ConfigError`` for a bad config and ``BenchProtocolError`` when a system returns
    inconsistent records.
    """
    console = console or Console()
    peak = matmul_peak_gflops(config.device) if config.measure_matmul_peak else None
    with contextlib.ExitStack() as stack:
        journal = Journal(out_dir / JOURNAL_NAME, config)
        stack.callback(journal.close)
        progress: Progress = NullProgress()
        if show_progress:
            progress = stack.enter_context(RichProgress(console=console))
        suite = BenchSuite(systems, config, probe, progress, peak_gflops=peak,
                           extra_systems=extra_systems, cost_probe=cost_probe,
                           journal=journal)
        report = asyncio.run(suite.run())
    write_json(report, json_path or out_dir / "bench.json")
    write_plots(report, out_dir)
    print_report(report, console)
    return report
