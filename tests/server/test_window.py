"""Over HTTP: a user past max_seq_len is served from the newest window, and slides are counted."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest
import torch

from relaygr.cascade.system import RelaySystem
from relaygr.server import RelayService, ServerConfig
from relaygr.server.build import load_model
from tests.server.helpers import SOURCE, make_service, run_with_client
from tests.tolerance import SCORE_TOL

WIDTH, BLOCK = SOURCE.max_seq_len, SOURCE.max_seq_len // 8   # the default slide: an eighth


def window_start(total_events: int) -> int:
    """Where the window of ``total_events`` starts, from its definition (docs/serving.md)."""
    return 0 if total_events <= WIDTH else -(-(total_events - WIDTH) // BLOCK) * BLOCK


async def serve_across_slides(client: httpx.AsyncClient, service: RelayService, user: int,
                              visits: int = 8, size: int = 40) -> list[dict[str, Any]]:
    """``user`` brought to max_seq_len events, then ``visits`` visits of ``size`` events (each
    after the last one's background work settled): each answer reads the window its definition
    gives and scores as a fresh full pass over it. Returns the answers."""
    store = service.backend.store
    model = load_model(SOURCE)              # the served weights, rebuilt from the seed
    n, last = store.num_events(user), int(store.get(user).timestamps[-1])  # type: ignore[index]
    r = await client.post("/v1/events", json={"user_id": user, "items": [7] * (WIDTH - n),
                                              "timestamps": [last] * (WIDTH - n)})
    assert r.status_code == 200, r.text
    answers = []
    for i in range(visits):
        await service.backend.quiesce()
        history = store.get(user)
        assert history.timestamps is not None
        start = window_start(history.num_events + size)
        items = [1 + (13 * i + k) % SOURCE.num_items for k in range(size)]
        ts = [last + 1 + i] * size
        r = await client.post("/v1/recommend", json={
            "user_id": user, "recent_items": items, "recent_timestamps": ts,
            "request_ts": last + 1 + i})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["window_start"] == start and out["prefix_tokens"] + size <= WIDTH
        want = model.rank(torch.tensor(out["candidates"]),
                          prefix_items=torch.tensor(history.items[start:]),
                          prefix_timestamps=torch.tensor(history.timestamps[start:]),
                          suffix_items=torch.tensor(items), suffix_timestamps=torch.tensor(ts),
                          query_timestamp=last + 1 + i)
        torch.testing.assert_close(torch.tensor(out["scores"]), want, atol=SCORE_TOL,
                                   rtol=SCORE_TOL)
        answers.append(out)
    return answers


def slides_of(visits: int, size: int) -> int:
    """How many of ``visits`` visits of ``size`` events from max_seq_len events moved the
    window (what relaygr_window_slides counts)."""
    starts = [window_start(WIDTH + size * i) for i in range(visits + 1)]
    return sum(a != b for a, b in itertools.pairwise(starts))


def _metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].split()[1])


def test_a_user_at_max_seq_len_appends_and_is_served_from_the_slid_window() -> None:
    service = make_service(server=ServerConfig(max_candidates=8))
    system: RelaySystem = service.backend.system  # type: ignore[attr-defined]
    store = system.store
    user = min(store, key=store.num_events)

    async def body(client: httpx.AsyncClient) -> None:
        n, last = store.num_events(user), int(store.get(user).timestamps[-1])  # type: ignore[index]
        fill = WIDTH - n                         # the user reaches exactly max_seq_len events
        r = await client.post("/v1/events", json={"user_id": user, "items": [7] * fill,
                                                  "timestamps": [last + 1] * fill})
        assert r.status_code == 200 and r.json()["num_events"] == WIDTH, r.text
        history = store.get(user)
        assert history.timestamps is not None
        visit = {"user_id": user, "recent_items": [9], "recent_timestamps": [last + 2],
                 "request_ts": last + 3}
        r = await client.post("/v1/recommend", json=visit)       # one more event: 422 on main
        assert r.status_code == 200, r.text
        out = r.json()
        assert (out["window_start"], out["prefix_tokens"], out["suffix_tokens"]) == \
            (BLOCK, WIDTH - BLOCK, 1)
        want = system.model.rank(torch.tensor(out["candidates"]),
                                 prefix_items=torch.tensor(history.items[BLOCK:]),
                                 prefix_timestamps=torch.tensor(history.timestamps[BLOCK:]),
                                 suffix_items=torch.tensor([9]),
                                 suffix_timestamps=torch.tensor([last + 2]),
                                 query_timestamp=last + 3)
        torch.testing.assert_close(torch.tensor(out["scores"]), want, atol=SCORE_TOL,
                                   rtol=SCORE_TOL)
        r = await client.post("/v1/events", json={"user_id": user, "items": [5] * 600,
                                                  "timestamps": [last + 4] * 600})
        assert r.status_code == 200 and r.json()["num_events"] == WIDTH + 601, r.text
        r = await client.post("/v1/rank", json={"user_id": user, "candidates": [1, 2, 3]})
        assert r.status_code == 200 and r.json()["window_start"] == 640, r.text
        text = (await client.get("/metrics")).text
        assert _metric(text, "relaygr_window_slides_total") == 2.0   # 512 -> 513, 513 -> 1113
        assert _metric(text, "relaygr_windowed_requests_total") == 2.0

    run_with_client(service, body)


@pytest.mark.parametrize("instance_processes", [
    False, pytest.param(True, marks=pytest.mark.slow)])
def test_visits_across_slides_score_like_a_full_pass_over_the_window(
        instance_processes: bool) -> None:
    service = make_service(instance_processes=instance_processes)
    store = service.backend.store
    user = max(store, key=store.num_events)

    async def body(client: httpx.AsyncClient) -> None:
        answers = await serve_across_slides(client, service, user)
        counters = service.backend.snapshot().counters
        assert counters.window_slides == slides_of(8, 40) >= 3
        assert counters.windowed_requests == 8
        # the relay pre-infers each new window and reuses it until the next slide
        assert {a["path"] for a in answers} <= {"pending_wait", "device_hit", "host_hit"}

    run_with_client(service, body)
