"""Two running servers of one checkpoint, the relay and the baseline, asked the same visits.

    relaygr serve --checkpoint RUN --dataset D --data-dir DIR --events none --port 8401 &
    relaygr serve --checkpoint RUN --dataset D --data-dir DIR --events none --mode baseline \
        --port 8402 &
    PYTHONPATH=src python scripts/relay_vs_baseline.py --relay http://127.0.0.1:8401 \
        --baseline http://127.0.0.1:8402 --users 1-40 --visits 4 [--json OUT]

Each user (dataset ids, a range ``A-B``) visits ``--visits`` times, one user after another in
rounds. A visit sends the same ``/v1/recommend`` to both servers: the items the previous answer
put first (``--clicks`` of them, none on the first visit, and none on every third visit: a request
adding no events), timed after everything the user did (from ``--start-ts`` on, minutes apart),
and a request time just after them (no times for a user the servers hold untimed: a run with
``time_where_known``). The relay ranks from the prefix it pre-inferred or kept
from the user's previous visit; the baseline recomputes the whole window. Printed and written as
JSON: for how many visits both answered with the same candidates (the retrieval stage reads the
same history), the largest gap between the two ranker scores of a candidate, and the relay's
paths. ``--events none`` keeps the checkpoint's
event log as it was.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx


def _recommend(client: httpx.Client, url: str, body: dict[str, Any],
               untimed: set[int]) -> dict[str, Any]:
    """``/v1/recommend`` of ``body``; a user whose history the server holds untimed (a run
    with ``time_where_known``) is asked again without times, and remembered."""
    reply = client.post(f"{url}/v1/recommend", json=body)
    if reply.status_code == 422 and "untimed" in reply.text and "request_ts" in body:
        untimed.add(body["user_id"])
        body.pop("request_ts")
        body.pop("recent_timestamps", None)
        reply = client.post(f"{url}/v1/recommend", json=body)
    reply.raise_for_status()
    answer: dict[str, Any] = reply.json()
    return answer


def _users(spec: str) -> list[int]:
    first, _, last = spec.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--relay", required=True, help="the relay server's base URL")
    p.add_argument("--baseline", required=True, help="the baseline server's base URL")
    p.add_argument("--users", default="1-40", help="dataset user ids, A-B")
    p.add_argument("--visits", type=int, default=4)
    p.add_argument("--clicks", type=int, default=2, help="events a visit adds")
    p.add_argument("--candidates", type=int, default=64)
    p.add_argument("--start-ts", type=int, default=1_800_000_000,
                   help="the first visit's time (after every event of the dataset)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    users = _users(args.users)
    last: dict[int, list[int]] = {u: [] for u in users}     # the previous answer's candidates
    untimed: set[int] = set()                               # users the servers hold untimed
    now = args.start_ts
    same, worst = 0, 0.0
    paths: Counter[str] = Counter()
    preinfers: Counter[str] = Counter()
    with httpx.Client(timeout=120.0) as client:
        for visit in range(args.visits):
            for user in users:
                clicks = [] if visit % 3 == 2 else last[user][:args.clicks]
                times = [now + 60 * (i + 1) for i in range(len(clicks))]
                now += 60 * (len(clicks) + 2)
                body: dict[str, Any] = {"user_id": user, "recent_items": clicks,
                                        "num_candidates": args.candidates}
                if user not in untimed:
                    body["request_ts"] = now
                    if clicks:
                        body["recent_timestamps"] = times
                answers = [_recommend(client, url, body, untimed) for url in
                           (args.relay, args.baseline)]
                relay = answers[0]
                last[user] = relay["candidates"]
                paths[relay["path"]] += 1
                if relay.get("preinfer"):
                    preinfers[relay["preinfer"]["action"]] += 1
                scored = [dict(zip(a["candidates"], a["ranker_scores"], strict=True))
                          for a in answers]
                if scored[0].keys() == scored[1].keys():
                    same += 1
                    worst = max(worst, max(abs(scored[0][c] - scored[1][c]) for c in scored[0]))
    visits = len(users) * args.visits
    report = {"visits": visits, "untimed_users": len(untimed), "same_candidates": same,
              "max_abs_ranker_score_gap": worst,
              "relay_paths": dict(paths), "relay_preinfer_actions": dict(preinfers)}
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if same == visits else 1


if __name__ == "__main__":
    raise SystemExit(main())
