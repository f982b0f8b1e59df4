"""The KServe v2 (Open Inference Protocol) endpoints beside our own API.

Operators' tooling speaks it: ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/{name}``
(metadata), ``/v2/models/{name}/ready`` and ``/v2/models/{name}/infer``. An inference request
carries tensors by name: ``user_id`` (INT64, shape [1]) and, optionally, ``candidates`` (INT64,
shape [N], the dataset's item ids): with candidates it ranks them (as ``/v1/rank``), without it
runs the whole cascade (as ``/v1/recommend``). The answer holds ``candidates`` (INT64) and
``scores`` (FP32). It goes through the same ``RelayService`` operations, so admission,
validation, id translation and metrics are the same as on ``/v1`` (counted and timed under
KServe's own labels: the route's template, ``kserve_rank`` and ``kserve_recommend``); its
bodies are ``/v1``'s kind (``StrictBody``) and its tensors hold ``/v1``'s id types, so a tensor
accepts exactly what the ``/v1`` field it stands for accepts (``true`` and ``"3"`` are not ids;
``3.0`` is), refused with the same 422.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from relaygr.errors import InvalidInputError
from relaygr.server.config import ModelInfo
from relaygr.server.schemas import (
    ERROR_RESPONSES,
    ErrorResponse,
    ItemIds,
    Length,
    RankRequest,
    RecommendRequest,
    RecommendResponse,
    StrictBody,
    UserId,
)
from relaygr.server.service import RelayService

PLATFORM = "relaygr-hstu"
# The routes, as the request counter labels them (``app.ENDPOINTS``: templates, never a name).
INFER_PATH = "/v2/models/{name}/infer"
KSERVE_ENDPOINTS = frozenset({"/v2/health/live", "/v2/health/ready", "/v2/models/{name}",
                              "/v2/models/{name}/ready", INFER_PATH})


class UnknownModelError(InvalidInputError):
    """A ``/v2/models/{name}`` path names a model this server does not serve."""


Shape = Annotated[list[Length], Field(min_length=1, max_length=1)]


class UserIdTensor(StrictBody):
    """The ``user_id`` input: one id, as ``/v1``'s ``user_id``."""

    name: Literal["user_id"]
    shape: Shape
    datatype: str
    data: Annotated[list[UserId], Field(min_length=1, max_length=1)]


class CandidatesTensor(StrictBody):
    """The ``candidates`` input: item ids, as ``/v1/rank``'s ``candidates``."""

    name: Literal["candidates"]
    shape: Shape
    datatype: str
    data: ItemIds


TensorIn = Annotated[UserIdTensor | CandidatesTensor, Field(discriminator="name")]


class InferRequest(StrictBody):
    """An inference request: ``user_id`` and optionally ``candidates``, each once."""

    id: str | None = None
    inputs: Annotated[list[TensorIn], Field(min_length=1, max_length=2)]
    parameters: dict[str, Any] | None = None
    outputs: list[dict[str, Any]] | None = None


class TensorOut(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[float] | list[int]


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[TensorOut]


def _inputs(request: InferRequest) -> dict[str, list[int]]:
    by_name: dict[str, list[int]] = {}
    for tensor in request.inputs:
        if tensor.name in by_name:
            raise InvalidInputError(f"repeated input {tensor.name!r}: expected user_id and "
                                    "optionally candidates")
        if tensor.datatype != "INT64" or tensor.shape[0] != len(tensor.data):
            raise InvalidInputError(f"input {tensor.name!r} must be INT64 with shape "
                                    f"[{len(tensor.data)}]")
        by_name[tensor.name] = tensor.data
    if "user_id" not in by_name:
        raise InvalidInputError("input user_id is missing: it must hold exactly one id")
    return by_name


# A name other than the served model's (404), for the OpenAPI schema; inference answers the
# /v1 routes' errors too (``ERROR_RESPONSES``).
_UNKNOWN_MODEL: dict[int | str, dict[str, Any]] = {404: {"model": ErrorResponse}}


def install_kserve_routes(app: FastAPI, service: RelayService, info: ModelInfo) -> None:
    @app.exception_handler(UnknownModelError)
    async def unknown_model(_: Request, exc: UnknownModelError) -> JSONResponse:
        return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=404)

    def check(name: str) -> None:
        if name != info.name:
            raise UnknownModelError(f"this server serves model {info.name!r}, not {name!r}")

    def metadata() -> dict[str, Any]:
        return {"name": info.name, "versions": [info.version], "platform": PLATFORM,
                "inputs": [{"name": "user_id", "datatype": "INT64", "shape": [1]},
                           {"name": "candidates", "datatype": "INT64", "shape": [-1]}],
                "outputs": [{"name": "candidates", "datatype": "INT64", "shape": [-1]},
                            {"name": "scores", "datatype": "FP32", "shape": [-1]}]}

    def ready_body() -> JSONResponse:
        ready = service.readiness().ready
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/v2/health/live", summary="KServe v2: the process is up")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready", summary="KServe v2: ready to serve",
             responses={503: {"description": "not ready"}})
    async def ready() -> JSONResponse:
        return ready_body()

    @app.get("/v2/models/{name}", summary="KServe v2: the model's metadata",
             responses=_UNKNOWN_MODEL)
    async def model_metadata(name: str) -> dict[str, Any]:
        check(name)
        return metadata()

    @app.get("/v2/models/{name}/ready", summary="KServe v2: the model is ready",
             responses={**_UNKNOWN_MODEL, 503: {"description": "not ready"}})
    async def model_ready(name: str) -> JSONResponse:
        check(name)
        return ready_body()

    @app.post(INFER_PATH, response_model=InferResponse, responses=ERROR_RESPONSES,
              summary="KServe v2: rank candidates for a user, or run the whole cascade")
    async def infer(name: str, body: InferRequest) -> InferResponse:
        check(name)
        given = _inputs(body)
        user = given["user_id"][0]
        # the tensors were validated as these fields' types, so the bodies are valid
        request: RankRequest | RecommendRequest = (
            RankRequest(user_id=user, candidates=given["candidates"])
            if "candidates" in given else RecommendRequest(user_id=user))
        answer: RecommendResponse = (await service.rank(request, "kserve_rank")
                                     if isinstance(request, RankRequest)
                                     else await service.recommend(request, "kserve_recommend"))
        n = len(answer.candidates)
        return InferResponse(model_name=info.name, model_version=info.version, id=body.id,
                             outputs=[TensorOut(name="candidates", shape=[n], datatype="INT64",
                                                data=answer.candidates),
                                      TensorOut(name="scores", shape=[n], datatype="FP32",
                                                data=answer.scores)])
