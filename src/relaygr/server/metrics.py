"""Prometheus metrics of one server, in a registry of its own (``GET /metrics``).

Two kinds:
* observed per request (histograms and counters updated as requests finish): latency of each
  stage (earlier stages, ranking, whole request), ranking latency per path, requests by endpoint
  and status;
* read at scrape time from a ``ServingSnapshot`` (so nothing is counted twice): per instance,
  health, queue depths, cache bytes in use and budget per tier, cache hits and misses per tier,
  ranking paths, trigger decisions by reason, pre-infer actions, and what went wrong or was
  refused on the way (failed pre-infers and background copies, refused admissions and fills,
  host<->device copies failed or refused, entries evicted, expired or aborted per tier, ranking
  batches split after a failure and requests whose pass raised); per system, shed requests,
  failovers (and those whose instance raised), instances taken out by their circuit breaker, and
  pre-infer signals lost with their instance; history windows: slides (a user's
  window moved, so its cache is computed afresh) and requests ranked from a window that no
  longer starts at the first event; appends the history store's event log refused; requests
  refused at the server's door, by reason (draining, the in-flight limit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from relaygr.cascade.visit import Recommendation
from relaygr.server.snapshot import ServingSnapshot

# The ``endpoint`` label of the stage latencies: the ranking operations by the API that asked
# (``/v1/recommend``, ``/v1/rank``, and KServe's infer with or without candidates). A fixed set,
# so that the label set stays bounded.
STAGE_ENDPOINTS = frozenset({"recommend", "rank", "kserve_recommend", "kserve_rank"})

# Seconds: 1 ms to 10 s, denser where ranking SLOs sit (tens to hundreds of ms).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                     0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)


class SnapshotCollector(Collector):
    """Turns the backend's current ``ServingSnapshot`` into metric families at scrape time."""

    def __init__(self, snapshot: Callable[[], ServingSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        healthy = GaugeMetricFamily("relaygr_instance_healthy", "1 when the instance is up "
                                    "and its circuit breaker closed", labels=["instance"])
        queue = GaugeMetricFamily("relaygr_queue_depth", "Requests queued on an instance",
                                  labels=["instance", "queue"])
        used = GaugeMetricFamily("relaygr_cache_used_bytes", "KV bytes in use per tier",
                                 labels=["instance", "tier"])
        budget = GaugeMetricFamily("relaygr_cache_budget_bytes", "KV byte budget per tier",
                                   labels=["instance", "tier"])
        entries = GaugeMetricFamily("relaygr_cache_entries", "Prefixes held per tier",
                                    labels=["instance", "tier"])
        hits = CounterMetricFamily(
            "relaygr_cache_hits", "Ranking requests a tier served: the device, from K/V "
            "computed there ahead of ranking (paths device_hit, pending_wait); the host, from "
            "its copy (host_hit)", labels=["instance", "tier"])
        misses = CounterMetricFamily(
            "relaygr_cache_misses", "Ranking requests a tier did not serve (of those the "
            "device missed, for the host), stale ones included: hits + misses are the "
            "requests the tier was asked for", labels=["instance", "tier"])
        paths = CounterMetricFamily("relaygr_rank_paths", "Ranking requests by path",
                                    labels=["instance", "path"])
        trigger = CounterMetricFamily("relaygr_trigger_decisions", "Trigger decisions by reason",
                                      labels=["instance", "reason"])
        preinfer = CounterMetricFamily("relaygr_preinfer_actions", "Pre-infer signals by action",
                                       labels=["instance", "action"])
        residency = CounterMetricFamily(
            "relaygr_residency_events", "An instance's cache work by event: prefills started and "
            "failed, reloads started, background work failed, admissions refused, fills done and "
            "refused, ranking requests that waited on a prefix", labels=["instance", "event"])
        copies = CounterMetricFamily(
            "relaygr_expander_events", "Host<->device KV copies by event (reloads and demotions "
            "done, shared, refused, failed, skipped)", labels=["instance", "event"])
        churn = CounterMetricFamily(
            "relaygr_cache_removals", "Prefixes a tier dropped, by reason (evicted for space, "
            "expired, aborted: a pre-infer or copy that did not finish)",
            labels=["instance", "tier", "reason"])
        failed = CounterMetricFamily(
            "relaygr_rank_failures", "Ranking batches run again one request at a time after "
            "failing (split) and requests whose own pass raised (failed)",
            labels=["instance", "event"])
        for inst in snap.instances:
            name = inst.name
            healthy.add_metric([name], 1.0 if inst.healthy else 0.0)
            queue.add_metric([name, "rank"], inst.rank_queue_depth)
            queue.add_metric([name, "prefill"], inst.prefill_queue_depth)
            for tier_name, tier in (("device", inst.device), ("host", inst.host)):
                if tier is None:
                    continue
                labels = [name, tier_name]
                used.add_metric(labels, tier.used_bytes)
                budget.add_metric(labels, tier.budget_bytes)
                entries.add_metric(labels, tier.entries)
                hits.add_metric(labels, tier.hits)
                misses.add_metric(labels, tier.misses + tier.stale_misses)
                for reason, count in (("evicted", tier.evictions), ("expired", tier.expired),
                                      ("aborted", tier.aborted)):
                    churn.add_metric([*labels, reason], count)
            for family, counts in ((paths, inst.paths), (trigger, inst.trigger),
                                   (preinfer, inst.preinfer_actions),
                                   (residency, inst.residency), (copies, _events(inst.expander))):
                for key, count in sorted(counts.items()):
                    family.add_metric([name, key], count)
            for event, key in (("split", "rank_batches_split"),
                               ("failed", "rank_requests_failed")):
                failed.add_metric([name, event], inst.compute.get(key, 0.0))
        yield from (healthy, queue, used, budget, entries, hits, misses, paths, trigger,
                    preinfer, residency, copies, churn, failed)
        shed = CounterMetricFamily("relaygr_shed", "Requests shed under overload, by leg",
                                   labels=["leg"])
        shed.add_metric(["preinfer"], snap.counters.shed_preinfer)
        shed.add_metric(["rank"], snap.counters.shed_rank)
        yield shed
        failovers = CounterMetricFamily("relaygr_failovers",
                                        "Ranking legs answered by another instance than "
                                        "their first leg's: it was gone, raised, or was out "
                                        "of routing when the leg came")
        failovers.add_metric([], snap.counters.failovers)
        errors = CounterMetricFamily("relaygr_instance_errors",
                                     "Failovers whose instance raised (the instance's fault, "
                                     "not the request's)")
        errors.add_metric([], snap.counters.instance_errors)
        yield from (failovers, errors)
        lost = CounterMetricFamily("relaygr_lost_preinfer",
                                   "Pre-infer signals that did nothing: their instance "
                                   "was gone, the pre-infer raised, or its ranking leg "
                                   "failed over to another instance")
        lost.add_metric([], snap.counters.lost_preinfer)
        yield lost
        lifecycle = CounterMetricFamily(
            "relaygr_instance_events", "Instance processes seen dead (exited by themselves), "
            "hung (alive but not answering: killed), restarted, failed to restart, given up; "
            "instances taken out of routing by their circuit breaker (breaker_open)",
            labels=["event"])
        lifecycle.add_metric(["death"], snap.counters.instance_deaths)
        lifecycle.add_metric(["hang"], snap.counters.instance_hangs)
        lifecycle.add_metric(["restart"], snap.counters.instance_restarts)
        lifecycle.add_metric(["failed_restart"], snap.counters.instance_failed_restarts)
        lifecycle.add_metric(["given_up"], snap.counters.instances_given_up)
        lifecycle.add_metric(["breaker_open"], snap.counters.breaker_opens)
        yield lifecycle
        slides = CounterMetricFamily(
            "relaygr_window_slides", "Appends that moved a user's history window (its cached "
            "prefix is then computed afresh)")
        slides.add_metric([], snap.counters.window_slides)
        windowed = CounterMetricFamily(
            "relaygr_windowed_requests", "Ranking requests whose history window starts after "
            "the user's first event (histories longer than max_seq_len)")
        windowed.add_metric([], snap.counters.windowed_requests)
        yield from (slides, windowed)


class ReadCounter(Collector):
    """One counter without labels whose value is read at scrape time (kept by its owner)."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation)
        family.add_metric([], self._read())
        yield family


class ReadLabelledCounter(Collector):
    """One counter with one label whose values are read at scrape time (kept by their owner);
    ``read`` returns every label value, zeros included, so the series exist from the start."""

    def __init__(self, name: str, documentation: str, label: str,
                 read: Callable[[], Mapping[str, int]]) -> None:
        self._name, self._documentation, self._label = name, documentation, label
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=[self._label])
        for value, count in sorted(self._read().items()):
            family.add_metric([value], count)
        yield family


def _events(counts: dict[str, int]) -> dict[str, int]:
    """``counts`` without its byte totals (``*_bytes``): what a counter of events holds."""
    return {k: v for k, v in counts.items() if not k.endswith("_bytes")}


class ServerMetrics:
    """The server's registry: per-request observations plus the snapshot collector."""

    def __init__(self, snapshot: Callable[[], ServingSnapshot],
                 log_write_failures: Callable[[], int] = lambda: 0,
                 door_refusals: Callable[[], Mapping[str, int]] = dict) -> None:
        """``log_write_failures``: the history store's (``HistoryStore.log_write_failures``);
        ``door_refusals``: requests refused at the door by reason (``Admission.refusals``)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("relaygr_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.stage_seconds = Histogram(
            "relaygr_stage_seconds", "Latency of a request's stages (earlier_stages: retrieval "
            "and pre-processing with their simulated delays; retrieval: the measured retrieval "
            "alone; ranking: due to scores; request: the whole call)",
            ["endpoint", "stage"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.ranking_seconds = Histogram(
            "relaygr_ranking_seconds", "Ranking latency (due to scores) by path", ["path"],
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.registry.register(SnapshotCollector(snapshot))
        self.registry.register(ReadCounter(
            "relaygr_event_log_write_failures", "Appends the event log refused (SQLite locked "
            "past its busy timeout, a full disk): nothing appended, the request answered 503",
            log_write_failures))
        self.registry.register(ReadLabelledCounter(
            "relaygr_door_refusals", "Requests refused at the server's door with a 503 before "
            "any work, by reason: draining (shutting down), in_flight_limit (max_in_flight "
            "admitted) or user_in_flight_limit (max_in_flight_per_user of that user admitted)",
            "reason", door_refusals))
        self.in_flight = Gauge("relaygr_in_flight", "Requests admitted and not yet answered",
                               registry=self.registry)
        self._model_info = Gauge("relaygr_model_info", "The served model (value 1)",
                                 ["name", "version", "digest"], registry=self.registry)

    def describe_model(self, name: str, version: str, digest: str) -> None:
        self._model_info.labels(name, version, digest).set(1)

    def observe(self, endpoint: str, rec: Recommendation, start_s: float, end_s: float) -> None:
        """Record one answered ranking request under ``endpoint`` (one of ``STAGE_ENDPOINTS``;
        times are ``time.perf_counter()`` seconds); the earlier stages where they ran."""
        assert endpoint in STAGE_ENDPOINTS, f"stage endpoint {endpoint!r} is not a label"
        ranking_s = rec.ranking_done_s - rec.ranking_due_s
        if rec.stages is not None:     # the whole cascade ran: retrieval and pre-processing
            self.stage_seconds.labels(endpoint, "earlier_stages").observe(
                max(0.0, rec.ranking_due_s - start_s))
            self.stage_seconds.labels(endpoint, "retrieval").observe(rec.stages.retrieval_s)
        self.stage_seconds.labels(endpoint, "ranking").observe(ranking_s)
        self.stage_seconds.labels(endpoint, "request").observe(end_s - start_s)
        self.ranking_seconds.labels(rec.path.value).observe(ranking_s)

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
