"""Bad requests get a 4xx that says what is wrong, and change nothing (store, caches, counters)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaygr.server import ServerConfig
from tests.server.helpers import (
    client_for,
    make_service,
    make_untimed_service,
    run_with_client,
    system_config,
)

SERVER = ServerConfig(max_candidates=8, max_events_per_request=300, max_body_bytes=4096)


def _longest(service: Any) -> tuple[int, int, int]:
    store = service.backend.store
    user = max(store, key=store.num_events)
    return user, store.num_events(user), int(store.get(user).timestamps[-1])


def cases(user: int, last_ts: int) -> list[tuple[str, Any, int, str, str]]:
    """(endpoint, body, status, error type, words the message must contain)."""
    ok_ts = [last_ts + 1]
    return [
        ("/v1/recommend", {"user_id": "1"}, 422, "RequestValidationError",
         "user_id: Value error, expected an integer, got str '1'"),
        ("/v1/recommend", {"user_id": True}, 422, "RequestValidationError", "got bool"),
        ("/v1/recommend", {"user_id": 1.5}, 422, "RequestValidationError", "user_id"),
        ("/v1/recommend", {"user_id": -1}, 422, "RequestValidationError", "greater than"),
        ("/v1/recommend", {"user_id": 1, "colour": "red"}, 422, "RequestValidationError",
         "colour: Extra inputs"),
        ("/v1/recommend", {}, 422, "RequestValidationError", "user_id: Field required"),
        ("/v1/recommend", [1, 2], 422, "RequestValidationError", "body"),
        ("/v1/recommend", {"user_id": 77_777}, 404, "UnknownUserError", "user 77777"),
        ("/v1/recommend", {"user_id": 1, "num_candidates": 65}, 422, "InvalidInputError",
         "at most 8"),
        ("/v1/recommend", {"user_id": user, "recent_items": [3]}, 422, "TimestampError",
         "history is timed"),
        ("/v1/recommend", {"user_id": user, "recent_items": [3, 4],
                           "recent_timestamps": ok_ts}, 422, "TimestampError",
         "2 entries but recent_timestamps has 1"),
        ("/v1/recommend", {"user_id": user, "recent_items": [3],
                           "recent_timestamps": [last_ts - 1]}, 422, "TimestampError",
         "time order"),
        ("/v1/recommend", {"user_id": user, "recent_items": [501],
                           "recent_timestamps": ok_ts}, 422, "ItemOutOfRangeError",
         "item id 501"),
        ("/v1/rank", {"user_id": 1, "candidates": []}, 422, "RequestValidationError",
         "at least 1 item"),
        ("/v1/rank", {"user_id": 1, "candidates": list(range(1, 10))}, 422,
         "InvalidInputError", "9 entries"),
        ("/v1/rank", {"user_id": 1, "candidates": [0]}, 422, "RequestValidationError",
         "greater than or equal to 1"),
        ("/v1/rank", {"user_id": 1, "candidates": [1.5]}, 422, "RequestValidationError",
         "candidates.0: Value error, expected an integer, got 1.5"),
        ("/v1/rank", {"user_id": 1, "candidates": [2, 9999]}, 422, "ItemOutOfRangeError",
         "item id 9999; this model's item ids are 1..500"),
        ("/v1/rank", {"user_id": 1, "candidates": [2**53]}, 422, "RequestValidationError",
         "less than or equal"),
        ("/v1/rank", {"user_id": 77_777, "candidates": [2]}, 404, "UnknownUserError",
         "77777"),
        ("/v1/prefill", {"user_id": user, "suffix_tokens": 600}, 422,   # past the window
         "SequenceTooLongError", "suffix_tokens holds 600 events; a visit adds at most 448"),
        ("/v1/prefill", {"user_id": 77_777}, 404, "UnknownUserError", "no history"),
        ("/v1/prefill", {"user_id": user, "num_candidates": 9}, 422, "InvalidInputError",
         "num_candidates is 9; a /v1/rank request carries at most 8 candidates"),
        ("/v1/events", {"user_id": 1, "items": []}, 422, "RequestValidationError",
         "at least 1 item"),
        ("/v1/events", {"user_id": 1, "items": [4]}, 422, "TimestampError", "timed"),
        ("/v1/events", {"user_id": 1, "items": [4], "timestamps": [0]}, 422, "TimestampError",
         "time order"),
        ("/v1/events", {"user_id": 5_000, "items": [4, 5], "timestamps": [9, 3]}, 422,
         "TimestampError", "non-decreasing"),
        ("/v1/events", {"user_id": 5_000, "items": [600]}, 422, "ItemOutOfRangeError", "600"),
        ("/v1/events", {"user_id": 5_000, "items": [4, 5]}, 422, "TimestampError",  # new user
         "this model reads time; a new user's timestamps must give one timestamp per entry"),
    ]


def test_every_rejection_names_the_problem_and_changes_nothing() -> None:
    service = make_service(server=SERVER)
    user, _, last_ts = _longest(service)

    async def body(client: httpx.AsyncClient) -> None:
        await client.post("/v1/recommend", json={"user_id": 1})   # caches hold something
        before = await service.fingerprint()
        for endpoint, payload, status, error, words in cases(user, last_ts):
            r = await client.post(endpoint, json=payload)
            assert r.status_code == status, (endpoint, payload, r.text)
            out = r.json()
            assert out["error"] == error, (payload, out)
            assert words in out["detail"], (payload, out)
            assert await service.fingerprint() == before, (endpoint, payload)

    run_with_client(service, body)


def test_malformed_and_oversize_bodies() -> None:
    service = make_service(server=SERVER)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b" " * 1000

    async def body(client: httpx.AsyncClient) -> None:
        before = await service.fingerprint()
        bad_json = await client.post("/v1/recommend", content=b"{not json",
                                     headers={"content-type": "application/json"})
        assert bad_json.status_code == 422 and "JSON" in bad_json.json()["detail"]
        big = json.dumps({"user_id": 1, "candidates": [1] * 2000}).encode()
        declared = await client.post("/v1/rank", content=big,
                                     headers={"content-type": "application/json"})
        assert declared.status_code == 413
        assert declared.json()["detail"].endswith("the limit is 4096")
        streamed = await client.post("/v1/rank", content=chunks(),
                                     headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        assert "content-length" not in streamed.request.headers
        assert await service.fingerprint() == before

    run_with_client(service, body)


def test_an_untimed_model_serves_untimed_users_only(tmp_path: Path) -> None:
    """A model trained without time (the training default) is served untimed users: a new
    user's events carry no timestamps, and a visit of an untimed user none either."""
    service = make_untimed_service(tmp_path)
    user = next(iter(service.backend.store))

    async def body(client: httpx.AsyncClient) -> None:
        before = await service.fingerprint()
        r = await client.post("/v1/events", json={"user_id": 9_000, "items": [1, 2],
                                                  "timestamps": [5, 6]})
        assert r.status_code == 422 and r.json()["error"] == "TimestampError", r.text
        assert "this model is untimed; a new user's timestamps must be omitted" in \
            r.json()["detail"]
        assert 9_000 not in service.backend.store
        assert await service.fingerprint() == before
        assert (await client.post("/v1/events", json={"user_id": 9_000, "items": [1, 2]})
                ).status_code == 200
        assert service.backend.store.get(9_000).timestamps is None
        before = await service.fingerprint()
        for payload in ({"user_id": 9_000, "request_ts": 5},
                        {"user_id": user, "recent_items": [1], "recent_timestamps": [5]}):
            r = await client.post("/v1/recommend", json=payload)
            assert r.status_code == 422 and r.json()["error"] == "TimestampError"
            assert "untimed" in r.json()["detail"]
        assert await service.fingerprint() == before

    run_with_client(service, body)


# ---- property: whatever arrives, no 5xx, and a rejection changes nothing -------------------
FIELDS = ["user_id", "recent_items", "recent_timestamps", "request_ts", "num_candidates",
          "candidates", "suffix_tokens", "items", "timestamps", "expected_events", "junk"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.integers(0, 30), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=4))
values = st.one_of(scalars, st.lists(st.one_of(st.integers(-3, 600), st.integers(0, 2**64),
                                               st.text(max_size=2)), max_size=12))
bodies = st.one_of(st.dictionaries(st.sampled_from(FIELDS), values, max_size=5), values)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoint=st.sampled_from(["/v1/recommend", "/v1/rank", "/v1/prefill", "/v1/events"]),
       payload=bodies)
def test_fuzzed_bodies_never_fail_the_server(endpoint: str, payload: Any) -> None:
    status, changed = _LOOP.run_until_complete(_post(endpoint, payload))
    assert status < 500
    if status >= 400:
        assert not changed


_LOOP = asyncio.new_event_loop()
_STATE: dict[str, Any] = {}


async def _post(endpoint: str, payload: Any) -> tuple[int, bool]:
    if "client" not in _STATE:
        system = system_config(stages={"retrieval_k": 16, "num_candidates": 4})
        service = make_service(system, SERVER)
        context = client_for(service)
        _STATE.update(service=service, context=context, client=await context.__aenter__())
    service, client = _STATE["service"], _STATE["client"]
    before = await service.fingerprint()
    r = await client.post(endpoint, json=payload)
    return r.status_code, await service.fingerprint() != before


@pytest.fixture(scope="module", autouse=True)
def _close_fuzz_app() -> Any:
    yield
    if "context" in _STATE:
        _LOOP.run_until_complete(_STATE["context"].__aexit__(None, None, None))
    _LOOP.close()
