"""A soak of ``relaygr serve`` with a trained ML-1M checkpoint, as a user would run it (issue 23).

    PYTHONPATH=src python scripts/soak_ml1m.py --checkpoint RUN \
        --data-dir ../shared/datasets/ml-1m [--minutes 10] [--qps 8] [--json out.json] \
        [--ray [--replica-cpus 0.5]]

One server (embedded, two instance processes, appended events kept in an SQLite file), a steady
open-loop request rate of ``/v1/recommend`` with one user per request drawn from all users of the
dataset, each visit appending ``--visit-events`` events. Half the requests go to the users closest
below ``max_seq_len``, so that well over 100 of them cross it (their windows slide). During the run:
one instance process killed (SIGKILL) at 20 % and another at 40 % of the time, and the whole service
restarted (SIGTERM, then started again) at 60 %; events acknowledged before the restart are checked
after it. With ``--ray`` the service is ``serve --ray`` (an ingress and two ranking replicas on a
local Ray cluster): one ranking replica's process is killed at 20 % (Ray Serve starts a new one; the
script reports when it appeared), then the same restart. Printed and written as JSON: requests sent
and answered, answers by status (connection errors while the service restarts counted apart), P50 /
P99 of answered requests, the instance deaths, restarts and window slides the service's metrics
report, and each process's peak RSS (every process descended from the server: Ray's too), with the
whole service's peak RSS and PSS (sampled once a second). RSS counts a page shared by several
processes (torch's libraries, mapped by every one) in each of them; PSS splits it between them, so
the PSS total is what the service takes from the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np

PY = sys.executable


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux ``/proc``)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...)."""
    out, todo = [], [pid]
    while todo:
        found = children(todo.pop())
        out += found
        todo += found
    return out


def label(pid: int) -> str:
    """A process's name, short: a Ray worker's actor class (``ray::<title>``, whose title changes
    with the task it runs), else the program and its first argument."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in args if a]
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return "ray " + words[0].split(".")[0].rsplit(":", 1)[-1]
    tail = next((w for w in words[1:] if not w.startswith("-")), "")
    return f"{Path(words[0]).name} {Path(tail).name}".strip()[:60]


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def pss_mb(pid: int) -> float:
    """Proportional set size: private pages plus a share of each shared one (Linux >= 4.14)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Service:
    """The ``relaygr serve`` process, started and stopped as an operator would."""

    def __init__(self, args: argparse.Namespace, events_file: Path) -> None:
        self.cmd = [PY, "-m", "relaygr", "serve", "--checkpoint", str(args.checkpoint),
                    "--dataset", "ml-1m", "--data-dir", str(args.data_dir), "--instances", "2",
                    "--events", str(events_file), "--port", str(args.port)]
        self.cmd += (["--ray", "--replica-cpus", str(args.replica_cpus)] if args.ray
                     else ["--instance-processes", "on"])
        self.url = f"http://127.0.0.1:{args.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = open(args.log, "ab")  # noqa: SIM115 (kept open for the service's life)
        self.peak_rss: defaultdict[str, float] = defaultdict(float)
        self.names: dict[int, str] = {}     # pid -> its name (an idle Ray worker's last role)

    def start(self) -> float:
        started = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": "src"})
        while True:
            time.sleep(0.5)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)

    def sample_rss(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.peak_rss["server"] = max(self.peak_rss["server"], rss_mb(self.proc.pid))
        total = rss_mb(self.proc.pid)
        total_pss = pss_mb(self.proc.pid)
        for pid in sorted(descendants(self.proc.pid)):
            mb = rss_mb(pid)
            total += mb
            total_pss += pss_mb(pid)
            name = label(pid)
            if name != "ray IDLE" or pid not in self.names:
                self.names[pid] = name
            self.peak_rss[str(pid)] = max(self.peak_rss[str(pid)], mb)
        self.peak_rss["total"] = max(self.peak_rss["total"], total)
        self.peak_rss["total_pss"] = max(self.peak_rss["total_pss"], total_pss)

    def instance_pids(self) -> list[int]:
        """The instance processes: the server's children of more than 100 MB (the others are
        multiprocessing's resource tracker)."""
        assert self.proc is not None
        return [p for p in children(self.proc.pid) if rss_mb(p) > 100]

    def replica_pids(self) -> list[int]:
        """The ranking replicas' processes (``--ray``)."""
        assert self.proc is not None
        return [p for p in descendants(self.proc.pid) if "RankingReplica" in label(p)]


def users_and_items(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All users, each one's event count, and the catalogue's item ids (the dataset's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from relaygr.data import load_sequences
    seqs = load_sequences("ml-1m", args.data_dir)
    return (np.asarray(seqs.user_ids), np.diff(seqs.offsets).astype(np.int64),
            np.asarray(seqs.id_map.items))


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    users, lengths, items = users_and_items(args)
    rng = np.random.default_rng(args.seed)
    max_len = 200
    below = np.flatnonzero(lengths <= max_len)
    near = users[below[np.argsort(max_len - lengths[below])][:args.near_users]]
    # users no request touches: what they had acknowledged before the restart is checked after
    quiet = rng.choice(np.setdiff1d(users, near), 20, replace=False)
    users = np.setdiff1d(users, quiet)
    events_file = Path(args.events)
    events_file.unlink(missing_ok=True)
    service = Service(args, events_file)
    ready_s = [service.start()]
    duration = 60 * args.minutes
    codes: Counter[str] = Counter()
    errors: Counter[str] = Counter()     # answers other than 200, by status and body
    latencies: list[float] = []
    timed: list[tuple[float, float]] = []   # each answer: (sent at, s into the run; latency, ms)
    marks: dict[str, float] = {}                # when the operator acted, s into the run
    actions: list[str] = []
    restarting = asyncio.Event()
    checked: dict[int, int] = {}
    scraped_before: list[str] = []

    async def visit(client: httpx.AsyncClient, user: int) -> None:
        body = {"user_id": int(user), "num_candidates": 10,
                "recent_items": rng.choice(items, args.visit_events, replace=False).tolist()}
        started = time.perf_counter()
        try:
            r = await client.post(service.url + "/v1/recommend", json=body, timeout=30)
            codes[str(r.status_code)] += 1
            if r.status_code == 200:
                latencies.append(1e3 * (time.perf_counter() - started))
                timed.append((started - t0, latencies[-1]))
            else:
                errors[f"{r.status_code}: {r.text[:120]}"] += 1
        except httpx.HTTPError as exc:
            codes["restarting" if restarting.is_set() else type(exc).__name__] += 1

    async def kill_replica() -> None:
        before = service.replica_pids()
        os.kill(before[0], signal.SIGKILL)
        marks.setdefault("first kill", time.perf_counter() - t0)
        killed = time.perf_counter()
        actions.append(f"{killed - t0:.0f} s: SIGKILL ranking replica {before[0]} (of {before})")
        while len(set(service.replica_pids()) - set(before)) < 1:
            await asyncio.sleep(0.5)
        actions.append(f"{time.perf_counter() - t0:.0f} s: a new ranking replica process "
                       f"{sorted(set(service.replica_pids()) - set(before))}, "
                       f"{time.perf_counter() - killed:.1f} s after the kill")

    async def operator(client: httpx.AsyncClient) -> None:
        plan = ((0.2, "kill-replica"), (0.6, "restart")) if args.ray else \
            ((0.2, "kill"), (0.4, "kill"), (0.6, "restart"))
        for share, what in plan:
            await asyncio.sleep(share * duration - (time.perf_counter() - t0))
            if what == "kill-replica":
                await kill_replica()
                continue
            if what == "kill":
                pid = service.instance_pids()[0]
                os.kill(pid, signal.SIGKILL)
                marks.setdefault("first kill", time.perf_counter() - t0)
                actions.append(f"{time.perf_counter() - t0:.0f} s: SIGKILL instance {pid}")
                continue
            for user in quiet.tolist():      # acknowledged before the restart
                r = await client.post(service.url + "/v1/events",
                                      json={"user_id": user, "items": [int(items[0])]})
                checked[user] = r.json()["num_events"]
            scraped_before.append((await client.get(service.url + "/metrics")).text)
            restarting.set()
            marks["restart"] = time.perf_counter() - t0
            code = await asyncio.to_thread(service.stop)
            ready_s.append(await asyncio.to_thread(service.start))
            restarting.clear()
            marks["ready again"] = time.perf_counter() - t0
            actions.append(f"{time.perf_counter() - t0:.0f} s: restarted (exit {code}, ready "
                           f"in {ready_s[-1]:.1f} s)")

    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        ops = asyncio.create_task(operator(client))
        tasks = []
        sent = 0
        while (now := time.perf_counter() - t0) < duration:
            user = rng.choice(near) if rng.random() < 0.5 else rng.choice(users)
            tasks.append(asyncio.create_task(visit(client, int(user))))
            sent += 1
            if sent % args.qps == 0:
                service.sample_rss()
            await asyncio.sleep(max(0.0, sent / args.qps - now))
        await asyncio.gather(*tasks)
        await ops
        kept = {}
        for user, before in checked.items():
            r = await client.post(service.url + "/v1/events",
                                  json={"user_id": user, "items": [int(items[0])]})
            kept[user] = r.json()["num_events"] == before + 1
        metrics = (await client.get(service.url + "/metrics")).text
    service.stop()
    wanted = ("relaygr_instance_events_total", "relaygr_window_slides_total",
              "relaygr_failovers_total", "relaygr_instance_errors_total",
              "relaygr_windowed_requests_total",
              "relaygr_instance_healthy", "relaygr_http_requests_total")
    def pick(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(wanted)]
    lat = np.asarray(latencies)
    return {"minutes": args.minutes, "qps": args.qps, "ray": args.ray, "sent": sent,
            "codes": dict(codes), "errors": dict(errors),
            "answered": int(codes["200"]),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "marks_s": marks, "by_phase": by_phase(timed, marks),
            "actions": actions, "ready_s": ready_s,
            "acknowledged_kept_after_restart": f"{sum(kept.values())} of {len(kept)}",
            "metrics_before_restart": [pick(t) for t in scraped_before],
            "metrics_after_restart": pick(metrics),
            "slowest_ms": [(round(at, 1), round(ms)) for at, ms in
                           sorted(timed, key=lambda x: -x[1])[:20]],
            "peak_rss_mb": {(f"{service.names[int(k)]} [{k}]" if k.isdigit() else k): v
                            for k, v in service.peak_rss.items()},
            "near_users": len(near)}


def by_phase(answered: list[tuple[float, float]], marks: dict[str, float]
             ) -> dict[str, dict[str, float]]:
    """Count, P50 and P99 (ms) of the answered requests by when they were sent: before the first
    kill, from it to the restart, during the restart (sent before the service was ready again),
    after it."""
    edges = [0.0, marks.get("first kill", float("inf")), marks.get("restart", float("inf")),
             marks.get("ready again", float("inf")), float("inf")]
    names = ("before the first kill", "first kill to restart", "during the restart",
             "after the restart")
    out = {}
    for name, lo, hi in zip(names, edges, edges[1:], strict=False):
        ms = np.asarray([m for at, m in answered if lo <= at < hi])
        if ms.size:
            out[name] = {"answered": int(ms.size), "p50_ms": round(float(np.percentile(ms, 50)), 1),
                         "p99_ms": round(float(np.percentile(ms, 99)), 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--qps", type=int, default=8)
    parser.add_argument("--visit-events", type=int, default=10)
    parser.add_argument("--near-users", type=int, default=300)
    parser.add_argument("--port", type=int, default=8795)
    parser.add_argument("--events", default="/tmp/relaygr-soak-events.sqlite")
    parser.add_argument("--log", default="/tmp/relaygr-soak-serve.log")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--ray", action="store_true", help="serve --ray (two ranking replicas)")
    parser.add_argument("--replica-cpus", type=float, default=0.5)
    args = parser.parse_args()
    report = asyncio.run(soak(args))
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
