"""Reliability figures of ``relaygr serve`` (embedded), printed and written as JSON.

    PYTHONPATH=src python scripts/reliability.py [fuzz|soak|failover|all] [--quick]

* fuzz: schemathesis generates requests from the served OpenAPI schema (valid and invalid, per
  operation) against a live server on loopback; every answer must be < 500, conform to the
  schema, and a rejected request must leave the server's state fingerprint unchanged.
* soak: find the SLO-compliant QPS (highest step whose ranking P99 of answered requests is
  within the SLO and nothing is shed), then hold 1.5x that for a few minutes: server RSS over
  time, shed requests counted (client 503s == server counters), P99 of admitted requests,
  and after the run every pool and host tier passes ``check_integrity()`` with nothing pinned.
* failover: load at 0.7x the SLO-compliant QPS; fail an instance, later restart it; every
  request answered and scores equal a full recompute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.window import HistoryWindow
from relaygr.server.build import load_model, load_store
from relaygr.server.config import ModelSource, ServerConfig
from relaygr.server.loadgen import LoadResult, LoadSpec, run_open_loop
from relaygr.server.loopback import LoopbackServer, LoopbackSpec, ServerReport, rss_bytes

MODEL = ModelSource(size="small", num_items=10_000, max_seq_len=2048, num_users=2000,
                    min_events=64, max_events=1024)
# The ranking P99 budget of these runs. This 2-core box is shared (other jobs, and CPU steal
# of ~30% when measured), so single requests already see ~150 ms tails; 250 ms is a budget the
# box can meet at a non-trivial load. A lower risk fraction keeps the relay's trigger active at
# this budget (at risk: predicted full ranking > 37 ms, histories beyond ~600 events).
SLO_MS = 250.0
# Overload bounds: past 2 queued rankings an instance sheds. On this CPU box the bottleneck
# under overload is the CPU (and the GIL) the whole request shares, not the ranking queue, so
# the server also caps requests in flight at its door (Little's law: ~10 QPS x ~0.15 s is ~2
# in flight at the knee; 8 leaves room for bursts). Cache budgets sized for this 24 GiB box:
# ~60 device and ~250 host prefixes per instance.
SYSTEM = SystemConfig(num_instances=2, slo_ms=SLO_MS).with_(
    trigger={"risk_fraction": 0.15}, stages={"num_candidates": 64, "retrieval_k": 256},
    overload={"shed_preinfer_queue_depth": 1, "max_rank_queue_depth": 2},
    instance={"device_budget_bytes": 256 << 20, "host_budget_bytes": 1024 << 20})
MAX_IN_FLIGHT = 8


def cpu_jiffies() -> tuple[int, int]:
    """(busy, steal) jiffies of the whole machine so far (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq, steal


def process_jiffies(pid: int) -> int:
    """CPU time of a process (all its threads) so far, in jiffies."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(stat[11]) + int(stat[12])          # utime + stime


class MachineShare:
    """Who used the CPUs over a run: this test (server + load generator), others, the host."""

    def __init__(self, pids: tuple[int, ...]) -> None:
        self.pids = pids
        self.start = (time.perf_counter(), *cpu_jiffies(), self._ours())

    def _ours(self) -> int:
        return sum(process_jiffies(p) for p in self.pids)

    def result(self) -> dict[str, float]:
        wall, busy0, steal0, ours0 = self.start
        busy, steal = cpu_jiffies()
        hz = os.sysconf("SC_CLK_TCK")
        capacity = (time.perf_counter() - wall) * hz * (os.cpu_count() or 1)
        ours = self._ours() - ours0
        return {"cpus": os.cpu_count() or 1,
                "ours_pct": round(100 * ours / capacity, 1),
                "others_pct": round(100 * max(0, busy - busy0 - ours) / capacity, 1),
                "steal_pct": round(100 * (steal - steal0) / capacity, 1)}


def spec(system: SystemConfig = SYSTEM) -> LoopbackSpec:
    return LoopbackSpec(MODEL, system, ServerConfig(port=0, drain_timeout_s=10,
                                                    max_in_flight=MAX_IN_FLIGHT), None, 1)


def summary(result: LoadResult) -> dict[str, Any]:
    return {"offered_qps": result.offered_qps, "duration_s": result.duration_s,
            "counts": result.counts, "paths": result.paths(),
            "ranking_p50_ms": result.ranking_ms(50), "ranking_p99_ms": result.ranking_ms(99),
            "e2e_p50_ms": result.e2e_ms(50), "e2e_p99_ms": result.e2e_ms(99)}


def load(server: LoopbackServer, qps: float, duration_s: float, seed: int = 0,
         keep: bool = False, actions: tuple[Any, ...] = ()) -> LoadResult:
    users = tuple(range(1, MODEL.num_users + 1))
    return asyncio.run(run_open_loop(server.url, LoadSpec(qps, duration_s, users, seed=seed),
                                     keep, actions))


# ---- fuzz --------------------------------------------------------------------------------------
def fuzz(examples: int) -> dict[str, Any]:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.core.result import Err

    small = replace(MODEL, size="tiny", num_users=50, max_events=512)
    system = SYSTEM.with_(stages={"retrieval_k": 32, "num_candidates": 8})
    tally: dict[str, dict[str, int]] = {}
    problems: list[str] = []
    with LoopbackServer(LoopbackSpec(small, system, ServerConfig(port=0), None, 1)) as server:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        for result in schema.get_all_operations():
            if isinstance(result, Err):      # an operation the schema does not describe validly
                problems.append(f"invalid operation in the schema: {result.err()}")
                continue
            op = result.ok()
            for mode in list(schemathesis.GenerationMode):
                counts = tally.setdefault(f"{op.method.upper()} {op.path} {mode}", {})
                strategy = op.as_strategy(generation_mode=mode)
                if mode is schemathesis.GenerationMode.POSITIVE:
                    strategy = strategy.map(_mostly_known_user)
                test = given(case=strategy)(_fuzz_test(server, counts, problems))
                try:
                    settings(max_examples=examples, deadline=None, database=None,
                             suppress_health_check=list(HealthCheck))(test)()
                except Unsatisfiable:       # nothing to make invalid (no parameters, no body)
                    counts["no invalid input exists"] = 1
    return {"examples_per_mode": examples, "statuses": tally, "problems": problems[:20],
            "problem_count": len(problems)}


def _mostly_known_user(case: Any) -> Any:
    """Point valid bodies at users the server has (ids 1..50, of 0..63) and at items in its
    catalogue, so that valid requests reach ranking instead of all ending as unknown users."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if isinstance(body.get("user_id"), (int, float)):
        body["user_id"] = int(body["user_id"]) % 64
    for name in ("recent_items", "candidates", "items"):
        if isinstance(body.get(name), list):
            body[name] = [int(x) % MODEL.num_items + 1 for x in body[name]]
    return case


def _fuzz_test(server: LoopbackServer, counts: dict[str, int],
               problems: list[str]) -> Any:
    def test(case: Any) -> None:
        _fuzz_one(server, case, counts, problems)
    return test


def _fuzz_one(server: LoopbackServer, case: Any, counts: dict[str, int],
              problems: list[str]) -> None:
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    before = server.report().fingerprint
    response = case.call(base_url=server.url)
    status = response.status_code
    key = str(status)
    if 400 <= status < 500:
        key += " " + str(response.json().get("error", "?"))
    counts[key] = counts.get(key, 0) + 1
    if status >= 500:
        problems.append(f"{case.method} {case.path}: {status} {response.text[:200]}")
    if 400 <= status < 500 and server.report().fingerprint != before:
        problems.append(f"state changed by a rejected {case.method} {case.path}")
    try:
        # Schema conformance of every answer, documented status codes and headers, invalid
        # input rejected. Not "valid input accepted": the schema cannot say which users exist,
        # how large the catalogue is or how long a history may grow; those 4xx are tallied.
        case.validate_response(response, excluded_checks=[positive_data_acceptance])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # schemathesis raises a (Base)ExceptionGroup of failures
        problems.append(f"{case.method} {case.path}: {str(exc)[:400]}")


# ---- soak --------------------------------------------------------------------------------------
def slo_qps(server: LoopbackServer, steps: list[float], step_s: float) -> tuple[float, list]:
    """The highest step whose answered ranking P99 <= SLO with nothing shed or lost; the search
    ends after two failing steps in a row (one noisy step on a shared box does not end it)."""
    best, trials, failed_in_a_row = 0.0, [], 0
    for qps in steps:
        share = MachineShare((server.pid, os.getpid()))
        result = load(server, qps, step_s, seed=int(qps))
        trials.append(summary(result) | {"cpu": share.result()})
        passed = result.ranking_ms(99) <= SLO_MS and result.counts.get("answered", 0) == \
            len(result.outcomes)
        print(f"  {qps:5.1f} QPS: ranking P99 {result.ranking_ms(99):6.1f} ms, "
              f"{result.counts}, cpu {trials[-1]['cpu']} -> {'pass' if passed else 'fail'}",
              flush=True)
        failed_in_a_row = 0 if passed else failed_in_a_row + 1
        if passed:
            best = qps
        if failed_in_a_row == 2:
            break
    return best, trials


def shed_delta(before: ServerReport, after: ServerReport) -> dict[str, int]:
    """Requests the server shed between two reports, by where."""
    return {"rank": after.counters.shed_rank - before.counters.shed_rank,
            "door": after.refused_at_door - before.refused_at_door,
            "preinfer": after.counters.shed_preinfer - before.counters.shed_preinfer}


def soak(minutes: float, steps: list[float], step_s: float) -> dict[str, Any]:
    with LoopbackServer(spec()) as server:
        load(server, 2.0, min(20.0, step_s), seed=99)      # warm-up (first calls, caches)
        base, trials = slo_qps(server, steps, step_s)
        assert base > 0, "no QPS step met the SLO"
        qps = 1.5 * base
        rss: list[tuple[float, int]] = []
        start = time.perf_counter()
        samples = [(60.0 * minutes * k / 12, lambda: rss.append(
            (time.perf_counter() - start, rss_bytes(server.pid)))) for k in range(13)]
        print(f"soak at {qps:.1f} QPS (1.5 x {base}) for {minutes} min", flush=True)
        before = server.report()
        share = MachineShare((server.pid, os.getpid()))
        result = load(server, qps, 60.0 * minutes, seed=7, actions=tuple(samples))
        cpu = share.result()
        after = server.report()
        print(f"burst at {3 * base:.1f} QPS (3 x {base}) for 20 s", flush=True)
        burst = load(server, 3 * base, 20.0, seed=11)
        after_burst = server.report()
    half = [b for t, b in rss if t >= 30.0 * minutes]
    return {"slo_ms": SLO_MS, "slo_qps": base, "search": trials, "soak_qps": qps,
            "soak": summary(result), "soak_cpu": cpu,
            "soak_shed_client": result.counts.get("shed", 0),
            "soak_shed_server": shed_delta(before, after),
            "rss_mib": [(round(t), round(b / 2**20, 1)) for t, b in rss],
            "rss_growth_second_half_mib": round((max(half) - min(half)) / 2**20, 1),
            "integrity_error": after.integrity_error, "pinned_entries": after.pinned_entries,
            "in_flight_after": after.in_flight, "user_locks_after": after.user_locks,
            "burst_qps": 3 * base, "burst": summary(burst),
            "burst_shed_client": burst.counts.get("shed", 0),
            "burst_shed_server": shed_delta(after, after_burst),
            "burst_integrity_error": after_burst.integrity_error,
            "burst_pinned_entries": after_burst.pinned_entries}


# ---- failover ----------------------------------------------------------------------------------
def failover(qps: float, duration_s: float) -> dict[str, Any]:
    with LoopbackServer(spec()) as server:
        actions = ((duration_s / 4, lambda: server.fail("rank-1")),
                   (duration_s / 2, lambda: server.restart("rank-1")))
        share = MachineShare((server.pid, os.getpid()))
        result = load(server, qps, duration_s, seed=3, keep=True, actions=actions)
        cpu = share.result()
        after = server.report()
    model = load_model(MODEL)
    # the server's users, cut to its window (no visit appends events)
    store = load_store(MODEL, model, HistoryWindow.for_model(model.cfg, SYSTEM))
    worst = 0.0
    for o in result.answered()[::4]:
        assert o.body is not None
        h = store.get(o.user_id)
        want = model.rank(torch.tensor(o.body["candidates"]), prefix_items=torch.tensor(h.items),
                          prefix_timestamps=torch.tensor(h.timestamps))
        worst = max(worst, float((torch.tensor(o.body["scores"]) - want).abs().max()))
    by_instance: dict[str, int] = {}
    for o in result.answered():
        assert o.body is not None
        by_instance[o.body["instance"]] = by_instance.get(o.body["instance"], 0) + 1
    return {"qps": qps, "duration_s": duration_s, "fail_at_s": duration_s / 4,
            "restart_at_s": duration_s / 2, "load": summary(result), "cpu": cpu,
            "answered_by_instance": by_instance, "failovers": after.counters.failovers,
            "max_abs_score_diff_vs_full_recompute": worst,
            "checked_responses": len(result.answered()[::4]),
            "integrity_error": after.integrity_error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["fuzz", "soak", "failover", "all"], default="all",
                        nargs="?")
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test)")
    parser.add_argument("--out", type=Path, default=Path("out/reliability.json"))
    args = parser.parse_args()
    quick = args.quick
    steps = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0]
    figures: dict[str, Any] = {"machine": f"{platform.node()} ({platform.processor() or '?'}), "
                               f"{torch.get_num_threads()} torch threads, shared",
                               "model": asdict(MODEL) | {"checkpoint": None},
                               "system": asdict(SYSTEM)}
    if args.what in ("fuzz", "all"):
        figures["fuzz"] = fuzz(10 if quick else 60)
        print(json.dumps(figures["fuzz"], indent=1), flush=True)
    if args.what in ("soak", "all"):
        figures["soak"] = soak(0.5 if quick else 3.0, steps, 5.0 if quick else 30.0)
        print(json.dumps({k: v for k, v in figures["soak"].items()
                          if k not in ("search", "rss_mib")}, indent=1), flush=True)
    if args.what in ("failover", "all"):
        base = figures.get("soak", {}).get("slo_qps", 6.0)
        figures["failover"] = failover(max(1.0, 0.7 * base), 20.0 if quick else 60.0)
        print(json.dumps(figures["failover"], indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    bad = figures.get("fuzz", {}).get("problem_count", 0) or \
        figures.get("soak", {}).get("integrity_error") or \
        figures.get("failover", {}).get("load", {}).get("counts", {}).get("failed", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
