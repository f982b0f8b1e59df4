"""The serving operations of the HTTP API, independent of HTTP: admit, validate, serve, report.

Each operation: admission (in-flight cap, draining) -> the user's lock -> validation against
the current state -> the backend -> a response body, with latencies observed in the metrics.
Validation happens before the backend is touched, so a rejected request changes nothing;
errors are typed (``relaygr.errors``) and the app maps them to status codes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TypeVar

import torch

from relaygr import __version__
from relaygr.cascade.visit import Recommendation, Visit
from relaygr.server.admission import Admission, UserLocks
from relaygr.server.backend import PrefillOutcome, RelayBackend
from relaygr.server.catalog import ItemCatalog
from relaygr.server.config import ModelInfo, ServerConfig
from relaygr.server.metrics import ServerMetrics
from relaygr.server.schemas import (
    EventsRequest,
    EventsResponse,
    PrefillRequest,
    PreinferOut,
    RankRequest,
    ReadyResponse,
    RecommendRequest,
    RecommendResponse,
    StageTimings,
    VisitFields,
)
from relaygr.server.snapshot import StateFingerprint
from relaygr.server.validation import RequestValidator

_V = TypeVar("_V", bound=VisitFields)


@dataclass
class Lifecycle:
    started: bool = False
    stopped: bool = False
    drained_cleanly: bool = True


class RelayService:
    """See the module docstring. One event loop drives it (the server's)."""

    def __init__(self, backend: RelayBackend, config: ServerConfig | None = None,
                 catalog: ItemCatalog | None = None, model_info: ModelInfo | None = None,
                 timed: bool = True) -> None:
        """``catalog`` translates the API's item ids (default: the model's dense ids);
        ``model_info`` names the model for KServe v2 and the metrics; ``timed``: whether the
        model reads time (``server.build.served_timed``; the default is random weights'), so
        that a user ``/v1/events`` adds carries timestamps exactly when it does."""
        self.backend = backend
        self.config = config or ServerConfig()
        self.catalog = catalog or ItemCatalog.identity(backend.model_config.num_items)
        self.model_info = model_info or ModelInfo("relaygr", __version__, "unknown")
        self.validator = RequestValidator(backend.model_config, backend.system_config,
                                          self.config, backend.store, timed)
        self.admission = Admission(self.config.max_in_flight, self.config.retry_after_s,
                                   self.config.max_in_flight_per_user)
        self.metrics = ServerMetrics(
            backend.snapshot, backend.store.log_write_failures,
            lambda: {reason.value: n for reason, n in self.admission.refusals.items()})
        self.metrics.describe_model(self.model_info.name, self.model_info.version,
                                    self.model_info.digest)
        self.metrics.in_flight.set_function(lambda: self.admission.in_flight)
        self.users = UserLocks()
        self.lifecycle = Lifecycle()

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.backend.start()
        self.lifecycle.started = True

    async def stop(self) -> None:
        """Drain in-flight requests (refusing new ones), stop the instances, then close the
        history store (its event log, and the log's lock, are let go)."""
        if self.lifecycle.stopped:
            return
        self.lifecycle.drained_cleanly = await self.admission.drain(self.config.drain_timeout_s)
        self.lifecycle.stopped = True
        try:
            await self.backend.stop()
        finally:
            self.backend.store.close()

    def readiness(self) -> ReadyResponse:
        instances = self.backend.snapshot().instances
        unhealthy = {i.name: i.unhealthy_reason or "down" for i in instances if not i.healthy}
        healthy = sum(1 for i in instances if i.healthy)
        store_error = self.backend.store.unavailable()
        store = store_error is None
        ready = self.lifecycle.started and not self.admission.draining and healthy > 0 and store
        return ReadyResponse(ready=ready, draining=self.admission.draining,
                             healthy_instances=healthy, instances=len(instances),
                             history_store=store, history_store_error=store_error,
                             unhealthy=unhealthy)

    async def fingerprint(self) -> StateFingerprint:
        """The state a request could change, once background work has settled."""
        await self.backend.quiesce()
        return StateFingerprint.of(self.backend.store, self.backend.snapshot())

    # ---- operations --------------------------------------------------------------------------
    async def recommend(self, request: RecommendRequest,
                        endpoint: str = "recommend") -> RecommendResponse:
        """The whole cascade; its latencies observed under ``endpoint`` (the API that asked,
        ``metrics.STAGE_ENDPOINTS``)."""
        start = time.perf_counter()
        request = self._dense_visit(request)
        async with self.admission.admit(request.user_id), self.users.hold(request.user_id):
            self.validator.visit(request)
            self.validator.num_candidates(request.num_candidates)
            rec = await self.backend.recommend(_visit(request, request.num_candidates))
        return self._answer(endpoint, request.user_id, rec, start, best_first=True)

    async def rank(self, request: RankRequest, endpoint: str = "rank") -> RecommendResponse:
        """Rank the given candidates (in their order); latencies observed under ``endpoint``."""
        start = time.perf_counter()
        if self.catalog.translates:
            request = self._dense_visit(request).model_copy(
                update={"candidates": self.catalog.to_model(request.candidates)})
        async with self.admission.admit(request.user_id), self.users.hold(request.user_id):
            self.validator.visit(request)
            self.validator.candidates(request.candidates)
            candidates = torch.tensor(request.candidates, dtype=torch.int64)
            rec = await self.backend.rank(_visit(request, len(request.candidates)), candidates)
        return self._answer(endpoint, request.user_id, rec, start, best_first=False)

    async def prefill(self, request: PrefillRequest) -> PreinferOut:
        async with self.admission.admit(request.user_id):
            self.validator.prefill(request)
            outcome = await self.backend.prefill(request.user_id, request.suffix_tokens,
                                                 request.num_candidates)
        return _preinfer_out(outcome)

    async def events(self, request: EventsRequest) -> EventsResponse:
        if self.catalog.translates:
            request = request.model_copy(
                update={"items": self.catalog.to_model(request.items)})
        async with self.admission.admit(request.user_id), self.users.hold(request.user_id):
            self.validator.events(request)
            count = self.backend.append_events(request.user_id, request.items,
                                               request.timestamps, request.expected_events)
        return EventsResponse(user_id=request.user_id, num_events=count)

    def _dense_visit(self, request: _V) -> _V:
        """The request with its item ids translated to the model's (``UnknownItemError``)."""
        if not self.catalog.translates:
            return request
        return request.model_copy(
            update={"recent_items": self.catalog.to_model(request.recent_items)})

    def _answer(self, endpoint: str, user_id: int, rec: Recommendation, start_s: float,
                best_first: bool) -> RecommendResponse:
        end_s = time.perf_counter()
        self.metrics.observe(endpoint, rec, start_s, end_s)
        preinfer = None
        if rec.preinfer is not None and rec.preinfer_instance is not None:
            preinfer = _preinfer_out(PrefillOutcome(rec.preinfer_instance, rec.preinfer))
        ids, scores = rec.candidates.cpu(), rec.final_scores.float().cpu()
        ranker = rec.scores.float().cpu()
        stage = None if rec.stage_scores is None else rec.stage_scores.float().cpu()
        if best_first:                   # the recommendation: best first (ties: retrieval's order)
            order = torch.argsort(scores, descending=True, stable=True)
            ids, scores, ranker = ids[order], scores[order], ranker[order]
            stage = None if stage is None else stage[order]
        candidates = self.catalog.to_api(ids.tolist())
        timings = _timings(rec, end_s - start_s)
        return RecommendResponse(
            user_id=user_id, candidates=candidates, titles=self.catalog.titles_of(candidates),
            scores=scores.tolist(), ranker_scores=ranker.tolist(),
            stage_scores=None if stage is None else stage.tolist(),
            stage_weight=rec.stage_weight, path=rec.path, instance=rec.instance,
            preinfer=preinfer, prefix_tokens=rec.prefix_tokens, suffix_tokens=rec.suffix_tokens,
            window_start=rec.window_start,
            ranking_ms=timings.ranking_ms, total_ms=timings.total_ms, timings=timings)


def _timings(rec: Recommendation, total_s: float) -> StageTimings:
    stages = rec.stages
    return StageTimings(
        retrieval_ms=None if stages is None else 1e3 * stages.retrieval_s,
        simulated_delay_ms=None if stages is None else 1e3 * stages.delay_s,
        ranking_ms=1e3 * (rec.ranking_done_s - rec.ranking_due_s), total_ms=1e3 * total_s)


def _visit(request: VisitFields, num_candidates: int | None) -> Visit:
    recent = tuple(request.recent_items)
    timestamps = None
    if recent and request.recent_timestamps is not None:
        timestamps = tuple(request.recent_timestamps)
    return Visit(request.user_id, recent, timestamps, request.request_ts, num_candidates,
                 request.expected_events)


def _preinfer_out(outcome: PrefillOutcome) -> PreinferOut:
    result = outcome.result
    return PreinferOut(instance=outcome.instance, action=result.action,
                       reason=None if result.reason is None else result.reason.value,
                       tokens=result.tokens)
