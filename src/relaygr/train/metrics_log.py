"""``metrics.jsonl``: a run's record of each validation and each ranking-phase epoch, one JSON
object a line, kept in step with its resumable state (``checkpoint.save_train_state``).

A record is written after what it describes and before the state that follows is saved, so a run
stopped between the two holds records its state does not know of (they are written again when
that work is redone); and a resumed run whose schedule goes on drops its ranking phase, run again
after the new epochs. So the first write of a session first rewrites the file (atomically) to what
the progress the session started from holds: its validations (``TrainProgress.history``, in
order) and, while ``rank_phase_done``, the records of the phase that followed the last of them.
A session that writes nothing leaves the file as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relaygr.files import write_atomic
from relaygr.train.checkpoint import TrainProgress

METRICS_FILE = "metrics.jsonl"
# The key that marks a ranking-phase record (a validation record has "epoch").
PHASE_KEY = "rank_phase_epoch"


class MetricsLog:
    """Appends to ``run_dir/metrics.jsonl`` for a session that started from ``progress`` (the
    module docstring); reads the progress now, so later changes to it do not matter."""

    def __init__(self, run_dir: Path, progress: TrainProgress) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.validations, self.phase = len(progress.history), progress.rank_phase_done
        self.synced = False

    def append(self, records: list[dict[str, Any]]) -> None:
        lines = [json.dumps(record) + "\n" for record in records]
        if not self.synced:
            text = "".join(self._kept() + lines)
            write_atomic(self.path, lambda tmp: tmp.write_text(text))
            self.synced = True
            return
        with self.path.open("a") as handle:
            handle.writelines(lines)

    def _kept(self) -> list[str]:
        """The file's lines the session's starting progress holds."""
        if not self.path.is_file():
            return []
        kept, seen = [], 0
        for line in self.path.read_text().splitlines(keepends=True):
            try:
                record = json.loads(line)
            except ValueError:      # a line cut short by a stop: past what any state holds
                continue
            if PHASE_KEY in record:
                if self.phase and seen == self.validations:
                    kept.append(line)
            else:
                if seen < self.validations:
                    kept.append(line)
                seen += 1
        return kept
