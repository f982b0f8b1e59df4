"""``expected_events``: an append's precondition, so that a client's retry after a timeout
appends its events once. Given and not the user's count, the request is a 409 whose body says
the count, and nothing is appended or ranked; without it, nothing changes."""

from __future__ import annotations

import httpx

from tests.server.helpers import make_service, run_with_client

T0 = 1_900_000_000          # after every synthetic event


def test_a_retried_append_with_its_precondition_is_refused_and_kept_once() -> None:
    service = make_service()
    store = service.backend.store
    before = store.get(1).items.tolist()
    n = len(before)

    async def body(client: httpx.AsyncClient) -> None:
        append = {"user_id": 1, "items": [5, 6], "timestamps": [T0, T0 + 1],
                  "expected_events": n}
        first = await client.post("/v1/events", json=append)
        assert first.status_code == 200 and first.json()["num_events"] == n + 2, first.text
        state = await service.fingerprint()
        retry = await client.post("/v1/events", json=append)      # the answer was lost
        assert retry.status_code == 409, retry.text
        assert retry.json() == {
            "error": "HistoryConflictError", "num_events": n + 2, "expected_events": n,
            "detail": f"user 1 has {n + 2} events, not the {n} this request expected "
                      "(expected_events): nothing appended"}
        assert await service.fingerprint() == state
        new = {"user_id": 90, "items": [5], "timestamps": [T0], "expected_events": 0}
        assert (await client.post("/v1/events", json=new)).status_code == 200   # created
        again = await client.post("/v1/events", json=new)
        assert again.status_code == 409 and again.json()["num_events"] == 1

    run_with_client(service, body)
    assert store.get(1).items.tolist() == [*before, 5, 6]
    assert store.get(90).items.tolist() == [5]


def test_a_retried_visit_with_its_precondition_is_refused_before_ranking() -> None:
    service = make_service()
    store = service.backend.store
    before = store.get(2).items.tolist()
    n = len(before)

    async def body(client: httpx.AsyncClient) -> None:
        for path, extra in (("/v1/rank", {"candidates": [11, 42]}), ("/v1/recommend", {})):
            count = store.num_events(2)
            t = T0 + count
            visit = {"user_id": 2, "recent_items": [7], "recent_timestamps": [t],
                     "expected_events": count, **extra}
            assert (await client.post(path, json=visit)).status_code == 200
            state = await service.fingerprint()
            retry = await client.post(path, json=visit)
            assert retry.status_code == 409, retry.text
            assert retry.json()["num_events"] == count + 1
            assert await service.fingerprint() == state      # nothing appended, nothing ranked

    run_with_client(service, body)
    assert store.get(2).items.tolist() == [*before, 7, 7]
    assert store.num_events(2) == n + 2


def test_without_the_precondition_a_retry_appends_again() -> None:
    service = make_service()
    n = service.backend.store.num_events(1)

    async def body(client: httpx.AsyncClient) -> list[int]:
        append = {"user_id": 1, "items": [5], "timestamps": [T0]}
        return [(await client.post("/v1/events", json=append)).json()["num_events"]
                for _ in range(2)]

    assert run_with_client(service, body) == [n + 1, n + 2]
