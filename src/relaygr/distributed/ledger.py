"""A replica-side record of every leg a ranking replica served (one JSON line per leg).

Each replica appends to its own file ``<dir>/<replica>.jsonl`` what it saw: the request, the leg,
the user, its own id, and the router's note for the call. Because the replica writes its own
identity, the records show where legs really ran, independently of what the router believed;
tests and the reliability script read them back with ``read_ledger``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from relaygr.engine.transport.messages import RoutedCall


@dataclass(frozen=True)
class LegRecord:
    request_id: str
    leg: str                 # "preinfer" or "rank"
    user_id: int
    replica: str             # the replica that served the leg (its own id)
    routed_to: str | None    # the router's decision for the call
    reason: str | None
    spilled: bool
    outcome: str             # the pre-infer action or the ranking path ("shed" when shed)


class LegLedger:
    """Appends ``LegRecord`` lines for one replica (line-buffered: a killed replica loses none
    of the legs it answered)."""

    def __init__(self, directory: Path, replica: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{replica}.jsonl"
        self.replica = replica

    def record(self, call: RoutedCall, leg: str, outcome: str) -> None:
        assert call.user_id is not None, "only user calls are recorded"
        note = call.note
        row = LegRecord(call.request_id, leg, call.user_id, self.replica,
                        None if note is None else note.instance_id,
                        None if note is None else note.reason,
                        False if note is None else note.spilled, outcome)
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(row)) + "\n")


def read_ledger(directory: Path) -> list[LegRecord]:
    """Every record of every replica in ``directory``."""
    rows = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(LegRecord(**json.loads(line)))
    return rows
