"""The benchmark's journal: each measured point and each finished phase, written as it happens.

A full run takes hours on a small CPU and ``bench.json`` is written at its end; a run stopped
before then (a session's time limit, a Ctrl-C, a lost machine) would leave nothing. The journal,
``points.jsonl`` in the run's output directory, is appended one JSON object per line and flushed
after each, so a stopped run keeps every point it finished and every phase answer it reached:

  {"event": "start", "at_s": 0.0, "started": ISO time, "config": {...the run's BenchConfig...}}
  {"event": "point", "at_s": ..., "point": {...PointStats, as in bench.json's "points"...}}
  {"event": "phase", "at_s": ..., "phase": "sweep" | "operating_point" | "throughput" |
   "mixed" | "<workload>" | "limit" | "exactness", "result": {...that phase's results...}}

``at_s`` is seconds since the run started (the run's own clock). A run that finishes writes the
same points into ``bench.json``; the journal is then a record of the order things happened in.
The file is replaced when a run starts in the same directory.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import IO, Any

from relaygr.bench.config import BenchConfig
from relaygr.bench.report import jsonable
from relaygr.bench.stats import PointStats

JOURNAL_NAME = "points.jsonl"


class Journal:
    """Appends the run's events to ``path`` (module docstring); ``close`` when the run ends."""

    def __init__(self, path: Path, config: BenchConfig) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._t0 = time.perf_counter()
        self._file: IO[str] | None = path.open("w", encoding="utf-8")
        self._write("start", started=dt.datetime.now(dt.timezone.utc).isoformat(),
                    config=config)

    def _write(self, event: str, **fields: Any) -> None:
        assert self._file is not None, f"the journal {self.path} is written after its close"
        line = {"event": event, "at_s": round(time.perf_counter() - self._t0, 3), **fields}
        self._file.write(json.dumps(jsonable(line), allow_nan=False) + "\n")
        self._file.flush()

    def point(self, stats: PointStats) -> None:
        """One measured point (every attempt of it is a point)."""
        self._write("point", point=stats.to_dict())

    def phase(self, name: str, result: object) -> None:
        """A phase's results, once it is finished."""
        self._write("phase", phase=name, result=result)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The events of a journal, in order; a last line cut off mid-write (the run was killed
    while writing it) is left out."""
    events = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise
    return events
