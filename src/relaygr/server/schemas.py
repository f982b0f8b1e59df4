"""The HTTP API's request and response bodies (pydantic, strict).

Requests are strict (``"1"`` and ``true`` are not integers, ``1.5`` is not an item id; ``2.0``
is, as JSON Schema's ``integer`` says) and closed (an unknown field is an error), and every
integer and list is bounded in the schema itself, so the OpenAPI
document says what is accepted. Bounds that depend on the served model or the configuration
(item ids up to ``num_items``, history length up to ``max_seq_len``, the candidate limit) are
checked by ``relaygr.server.validation`` and rejected with a typed error naming the limit.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from relaygr.data.servable import MAX_TIMESTAMP_S, MAX_USER_ID
from relaygr.engine.types import PreinferAction, RankPath
from relaygr.server.config import MAX_JSON_INT, MAX_LIST_ITEMS


def _json_integer(value: Any) -> Any:
    """JSON Schema's ``integer``: a number with no fractional part (``2.0`` is 2); never a
    string or a boolean."""
    if isinstance(value, (bool, str)):
        raise ValueError(f"expected an integer, got {type(value).__name__} {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    return value


# The bounds come before the validator so that they reach the schema as minimum/maximum. A
# user id's and a timestamp's are the ones every history store keeps and a served dataset's
# must meet (``data.servable``), so that no user is held that a request cannot name or extend.
_INTEGER = BeforeValidator(_json_integer)
UserId = Annotated[int, Field(ge=0, le=MAX_USER_ID, description="user id"), _INTEGER]
ItemId = Annotated[int, Field(ge=1, le=MAX_JSON_INT, description="item id (1..num_items)"),
                   _INTEGER]
Timestamp = Annotated[int, Field(ge=0, le=MAX_TIMESTAMP_S, description="unix seconds"), _INTEGER]
Count = Annotated[int, Field(ge=1, le=MAX_LIST_ITEMS), _INTEGER]
# An append's precondition (``expected_events``): a history has no length limit, so only JSON's
# exact-integer bound.
EventCount = Annotated[int, Field(ge=0, le=MAX_JSON_INT), _INTEGER]
EXPECTED_EVENTS_NOTE = (
    "the number of events the client believes the user has before this request's events are "
    "appended (0: a user the server does not hold); when given and not the store's count, the "
    "request is refused with 409 (HistoryConflictError, with the count) and nothing is "
    "appended, so a retry after a timeout appends once")
Length = Annotated[int, Field(ge=0, le=MAX_LIST_ITEMS), _INTEGER]
ItemList = Annotated[list[ItemId], Field(max_length=MAX_LIST_ITEMS)]
ItemIds = Annotated[list[ItemId], Field(min_length=1, max_length=MAX_LIST_ITEMS)]
TimestampList = Annotated[list[Timestamp], Field(max_length=MAX_LIST_ITEMS)]


class StrictBody(BaseModel):
    """A request body: strict (the types above are the only coercions), closed, frozen. Every
    API's bodies derive from it, KServe's included (``server.kserve``)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class VisitFields(StrictBody):
    """A user's visit: behaviours since their last visit (the ranking suffix) and the time."""

    user_id: UserId
    recent_items: ItemList = Field(default_factory=list)
    recent_timestamps: TimestampList | None = Field(
        default=None, description="required for a timed user, one per recent item")
    request_ts: Timestamp | None = Field(
        default=None, description="the time candidates are scored at (timed users only)")
    expected_events: EventCount | None = Field(default=None, description=EXPECTED_EVENTS_NOTE)


class RecommendRequest(VisitFields):
    """``POST /v1/recommend``: the whole cascade (retrieval, pre-processing, ranking)."""

    num_candidates: Count | None = Field(default=None,
                                         description="candidates to rank (default: server's)")


class RankRequest(VisitFields):
    """``POST /v1/rank``: rank these candidates (after a ``/v1/prefill`` when the caller runs
    its own earlier stages); the visit's recent items are appended to the history after."""

    candidates: ItemIds


class PrefillRequest(StrictBody):
    """``POST /v1/prefill``: the pre-infer signal for a user whose ranking request follows."""

    user_id: UserId
    suffix_tokens: Length = 0
    num_candidates: Count | None = None


class EventsRequest(StrictBody):
    """``POST /v1/events``: append behaviour events to a user's history (creating the user)."""

    user_id: UserId
    items: ItemIds
    timestamps: TimestampList | None = None
    expected_events: EventCount | None = Field(default=None, description=EXPECTED_EVENTS_NOTE)


class PreinferOut(BaseModel):
    """What the pre-infer signal did on the instance that got it."""

    instance: str
    action: PreinferAction
    reason: str | None = Field(description="the trigger's reason, when it decided")
    tokens: int


class StageTimings(BaseModel):
    """Where the request's time went, in ms. The stages are disjoint intervals of one clock,
    so ``retrieval_ms + simulated_delay_ms + ranking_ms <= total_ms``; the rest is admission,
    validation, id translation and waiting on the event loop."""

    retrieval_ms: float | None = Field(
        description="measured: the retrieval stage (user vector, index search, pre-processing's "
                    "filter) from hand-off to its candidates; null for /v1/rank (no retrieval)")
    simulated_delay_ms: float | None = Field(
        description="then waited for the configured earlier-stage delays (retrieval_delay_ms + "
                    "preprocess_delay_ms, standing for other fleets' time) beyond the measured "
                    "retrieval; 0 when they are 0, as with a trained retrieval stage; null for "
                    "/v1/rank")
    ranking_ms: float = Field(description="ranking: from due to scores (queue and compute)")
    total_ms: float = Field(description="the whole call, as the server saw it")


class RecommendResponse(BaseModel):
    """Candidates (/v1/recommend: best first by ``scores``; /v1/rank: the given order) and
    their scores, with how ranking ran."""

    user_id: int
    candidates: list[int]
    scores: list[float] = Field(
        description="the final score of each candidate, what /v1/recommend orders by: "
                    "ranker_scores + stage_weight x stage_scores (the ranker's alone when "
                    "stage_weight is 0)")
    ranker_scores: list[float] = Field(
        description="the ranking model's score of each candidate (exact on every path)")
    stage_scores: list[float] | None = Field(
        default=None, description="the retrieval stage's score of each candidate; null for "
                                  "/v1/rank (no retrieval ran)")
    stage_weight: float = Field(
        default=0.0, description="the weight of stage_scores in scores (serve --stage-weight; "
                                 "0 for /v1/rank)")
    path: RankPath
    instance: str
    preinfer: PreinferOut | None
    prefix_tokens: int
    suffix_tokens: int
    # The first history event the model read: 0 until the history outgrows max_seq_len, then
    # the start of the window that slides in blocks (docs/serving.md, "Long histories").
    window_start: int = 0
    ranking_ms: float
    total_ms: float
    timings: StageTimings
    titles: list[str | None] | None = Field(
        default=None, description="the candidates' titles, where the dataset has them")


class EventsResponse(BaseModel):
    user_id: int
    num_events: int


class HealthResponse(BaseModel):
    status: str


class ReadyResponse(BaseModel):
    ready: bool
    draining: bool
    healthy_instances: int
    instances: int
    history_store: bool       # the history store answers (a shared one can be out of reach)
    # why it does not (a shared store out of reach; the event log refused its last write)
    history_store_error: str | None = None
    # instance -> why it is not healthy ("down" where no more is known; a circuit breaker's
    # reason names the errors that opened it)
    unhealthy: dict[str, str] = Field(default_factory=dict)


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: the error's type name and a message saying what is wrong."""

    error: str
    detail: str


class ConflictResponse(ErrorResponse):
    """A 409's body: an append's ``expected_events`` was not the user's count; nothing was
    appended. ``num_events`` is the count now (what a retry that was applied finds)."""

    num_events: int
    expected_events: int


# The errors a route that serves requests may answer (bad input, unknown user or model,
# oversize body, overload), for the OpenAPI schema: FastAPI's ``responses=``.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 404, 413, 422, 503)}
# ... and of the routes that append events (a failed ``expected_events``).
APPEND_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES, 409: {"model": ConflictResponse}}
