"""The FastAPI application: routes, error mapping, middleware, lifespan.

``create_app(service)`` builds the ASGI app over a ``RelayService``; it opens no socket, so tests
drive it with httpx's ASGI transport and ``relaygr serve`` runs it on uvicorn (the Ray ingress
serves the same app). The lifespan starts the service and, on shutdown, drains in-flight
requests before stopping the instances.

Status codes: 200 answered; 400 a body that cannot be read as text; 404 unknown user (or path);
409 an append's ``expected_events`` is not the user's event count (nothing appended; the body
says the count); 413 body over the limit; 422 malformed or invalid input (wrong types, unknown
fields, ids outside the catalogue, sequences over the model's length, empty or oversize lists);
503 overloaded, draining, no healthy instance or the shared history store out of reach, with
``Retry-After``.
Every error body is ``{"error": <type>, "detail": <what is wrong>}`` (a 409's adds
``num_events`` and ``expected_events``).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from relaygr import __version__
from relaygr.errors import (
    HistoryConflictError,
    HistoryStoreUnavailableError,
    InvalidInputError,
    NoHealthyInstanceError,
    OverloadedError,
    UnknownUserError,
)
from relaygr.server.kserve import KSERVE_ENDPOINTS, install_kserve_routes
from relaygr.server.middleware import BodyLimit, StatusCounter
from relaygr.server.schemas import (
    APPEND_RESPONSES,
    ERROR_RESPONSES,
    ConflictResponse,
    ErrorResponse,
    EventsRequest,
    EventsResponse,
    HealthResponse,
    PrefillRequest,
    PreinferOut,
    RankRequest,
    ReadyResponse,
    RecommendRequest,
    RecommendResponse,
)
from relaygr.server.service import RelayService

# The request counter's endpoint labels: every route's path, templates as declared (one label
# for every model name); any other path is counted as ``other``.
ENDPOINTS = frozenset({"/v1/recommend", "/v1/prefill", "/v1/rank", "/v1/events", "/healthz",
                       "/readyz", "/metrics"}) | KSERVE_ENDPOINTS
RECOMMEND_DELAY_NOTE = (
    "Retrieval and pre-processing stand for other fleets: unless a trained retrieval stage "
    "serves (`relaygr serve --retrieval-run`), the request waits until the configured "
    "`retrieval_delay_ms + preprocess_delay_ms` (50 ms by default) have passed since it entered "
    "the cascade, whatever its retrieval computed, so every answer takes at least that long. "
    "With a trained stage both default to 0 and the request waits for the measured retrieval. "
    "`timings` says which: `retrieval_ms` (measured), `simulated_delay_ms` (waited for the "
    "configured delays), `ranking_ms`, `total_ms`.")
def _error(status: int, exc: Exception, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=type(exc).__name__, detail=str(exc))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "the request body is invalid"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = ErrorResponse(error=HTTPStatus(exc.status_code).phrase.replace(" ", ""),
                             detail=str(exc.detail))
        return JSONResponse(body.model_dump(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        body = ErrorResponse(error="RequestValidationError", detail=_validation_detail(exc))
        return JSONResponse(body.model_dump(), status_code=422)

    @app.exception_handler(UnknownUserError)
    async def unknown_user(_: Request, exc: UnknownUserError) -> JSONResponse:
        return _error(404, exc)

    @app.exception_handler(InvalidInputError)
    async def invalid_input(_: Request, exc: InvalidInputError) -> JSONResponse:
        return _error(422, exc)

    @app.exception_handler(HistoryConflictError)
    async def conflict(_: Request, exc: HistoryConflictError) -> JSONResponse:
        body = ConflictResponse(error=type(exc).__name__, detail=str(exc),
                                num_events=exc.num_events, expected_events=exc.expected_events)
        return JSONResponse(body.model_dump(), status_code=409)

    @app.exception_handler(OverloadedError)
    async def overloaded(_: Request, exc: OverloadedError) -> JSONResponse:
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))
        return _error(503, exc, {"Retry-After": retry_after})

    @app.exception_handler(NoHealthyInstanceError)
    async def no_instance(_: Request, exc: NoHealthyInstanceError) -> JSONResponse:
        return _error(503, exc, {"Retry-After": "1"})

    @app.exception_handler(HistoryStoreUnavailableError)
    async def store_unavailable(_: Request, exc: HistoryStoreUnavailableError) -> JSONResponse:
        return _error(503, exc, {"Retry-After": "1"})


def _install_routes(app: FastAPI, service: RelayService) -> None:
    @app.post("/v1/recommend", response_model=RecommendResponse, responses=APPEND_RESPONSES,
              summary="Run the whole cascade for a user: retrieval, pre-processing, ranking",
              description=RECOMMEND_DELAY_NOTE)
    async def recommend(body: RecommendRequest) -> RecommendResponse:
        return await service.recommend(body)

    @app.post("/v1/prefill", response_model=PreinferOut, responses=ERROR_RESPONSES,
              summary="The pre-infer signal: start computing the user's prefix K/V")
    async def prefill(body: PrefillRequest) -> PreinferOut:
        return await service.prefill(body)

    @app.post("/v1/rank", response_model=RecommendResponse, responses=APPEND_RESPONSES,
              summary="Rank given candidates, consuming the relayed prefix when present")
    async def rank(body: RankRequest) -> RecommendResponse:
        return await service.rank(body)

    @app.post("/v1/events", response_model=EventsResponse, responses=APPEND_RESPONSES,
              summary="Append behaviour events to a user's history")
    async def events(body: EventsRequest) -> EventsResponse:
        return await service.events(body)

    @app.get("/healthz", response_model=HealthResponse, summary="The process is up")
    async def healthz() -> HealthResponse:
        return HealthResponse(status="ok")

    @app.get("/readyz", response_model=ReadyResponse,
             responses={503: {"model": ReadyResponse}},
             summary="Ready to serve: started, not draining, an instance healthy")
    async def readyz() -> JSONResponse:
        ready = service.readiness()
        return JSONResponse(ready.model_dump(), status_code=200 if ready.ready else 503)

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics",
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(service: RelayService) -> FastAPI:
    """The HTTP API over ``service`` (see the module docstring)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="relaygr", version=__version__, lifespan=lifespan,
                  description="Relay-race inference for long-sequence generative "
                              "recommendation ranking.")
    _install_error_handlers(app)
    _install_routes(app, service)
    install_kserve_routes(app, service, service.model_info)
    app.add_middleware(BodyLimit, max_body_bytes=service.config.max_body_bytes)
    app.add_middleware(StatusCounter, count=service.metrics.count, endpoints=ENDPOINTS)
    return app
