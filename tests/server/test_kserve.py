"""KServe v2 endpoints answer as the protocol says, through the same service as /v1."""

from __future__ import annotations

import httpx
import pytest

from relaygr.server.app import ENDPOINTS, create_app
from tests.server.helpers import make_service, run_with_client
from tests.server.test_api import samples
from tests.tolerance import SCORE_TOL


def test_kserve_v2_health_metadata_and_inference() -> None:
    service = make_service()
    name = service.model_info.name
    infer = f"/v2/models/{name}/infer"

    async def body(client: httpx.AsyncClient) -> dict[str, httpx.Response]:
        ranked = {"inputs": [{"name": "user_id", "shape": [1], "datatype": "INT64",
                              "data": [3]},
                             {"name": "candidates", "shape": [3], "datatype": "INT64",
                              "data": [5, 9, 2]}], "id": "r1"}
        return {
            "live": await client.get("/v2/health/live"),
            "ready": await client.get("/v2/health/ready"),
            "meta": await client.get(f"/v2/models/{name}"),
            "other": await client.get("/v2/models/another"),
            "ranked": await client.post(infer, json=ranked),
            "v1": await client.post("/v1/rank", json={"user_id": 3, "candidates": [5, 9, 2]}),
            "cascade": await client.post(infer, json={"inputs": [
                {"name": "user_id", "shape": [1], "datatype": "INT64", "data": [4]}]}),
            "bad": await client.post(infer, json={"inputs": [
                {"name": "user_id", "shape": [1], "datatype": "FP32", "data": [4]}]}),
            "unknown_user": await client.post(infer, json={"inputs": [
                {"name": "user_id", "shape": [1], "datatype": "INT64", "data": [999_999]}]}),
            "metrics": await client.get("/metrics"),
        }

    r = run_with_client(service, body)
    assert r["live"].json() == {"live": True}
    assert r["ready"].status_code == 200 and r["ready"].json() == {"ready": True}
    assert r["meta"].json()["name"] == name == "hstu-tiny"
    assert [i["name"] for i in r["meta"].json()["inputs"]] == ["user_id", "candidates"]
    assert r["other"].status_code == 404
    out = {o["name"]: o for o in r["ranked"].json()["outputs"]}
    assert r["ranked"].json()["id"] == "r1" and out["candidates"]["data"] == [5, 9, 2]
    assert out["scores"]["datatype"] == "FP32" and out["scores"]["shape"] == [3]
    # the same user and candidates through /v1 (maybe from the cache the first call left)
    assert out["scores"]["data"] == pytest.approx(r["v1"].json()["scores"], abs=SCORE_TOL,
                                                  rel=SCORE_TOL)
    assert r["cascade"].status_code == 200
    assert len(r["cascade"].json()["outputs"][1]["data"]) > 0
    assert r["bad"].status_code == 422 and "INT64" in r["bad"].json()["detail"]
    assert r["unknown_user"].status_code == 404
    text = r["metrics"].text
    assert f'relaygr_model_info{{digest="{service.model_info.digest}",name="hstu-tiny"' in text
    assert "relaygr_in_flight 0.0" in text


def test_the_kserve_routes_document_the_errors_they_answer() -> None:
    """A name other than the served model's is a 404 with the error body, a server not ready
    a 503: both in the OpenAPI schema, where clients generated from it (and fuzzers) look."""
    service = make_service()

    async def body(client: httpx.AsyncClient) -> dict[str, object]:
        schema: dict[str, object] = (await client.get("/openapi.json")).json()
        return schema

    paths = run_with_client(service, body)["paths"]
    assert isinstance(paths, dict)
    for path, method in (("/v2/models/{name}", "get"), ("/v2/models/{name}/ready", "get"),
                         ("/v2/models/{name}/infer", "post")):
        documented = paths[path][method]["responses"]
        assert "404" in documented and documented["404"]["content"]["application/json"][
            "schema"]["$ref"].endswith("/ErrorResponse"), path
    assert "503" in paths["/v2/models/{name}/ready"]["get"]["responses"]
    assert "503" in paths["/v2/health/ready"]["get"]["responses"]


def _tensor(name: str, data: list[object], shape: list[object] | None = None) -> dict[str, object]:
    return {"name": name, "shape": [len(data)] if shape is None else shape, "datatype": "INT64",
            "data": data}


def test_kserve_tensors_accept_exactly_what_v1_accepts() -> None:
    """A tensor holds /v1's id types: ``true`` and ``"3"`` are refused with /v1's 422 (lax
    parsing read them as user 1 or item 3 and ranked them), an integral float is an id, and a
    refused request ranks nothing."""
    service = make_service()
    infer = f"/v2/models/{service.model_info.name}/infer"
    refused = {   # what each tensor holds -> the /v1/rank body with the same value
        "user true": ([_tensor("user_id", [True]), _tensor("candidates", [5])],
                      {"user_id": True, "candidates": [5]}),
        "user string": ([_tensor("user_id", ["3"]), _tensor("candidates", [5])],
                        {"user_id": "3", "candidates": [5]}),
        "item true": ([_tensor("user_id", [3]), _tensor("candidates", [5, True])],
                      {"user_id": 3, "candidates": [5, True]}),
        "item string": ([_tensor("user_id", [3]), _tensor("candidates", ["5"])],
                        {"user_id": 3, "candidates": ["5"]}),
        "item fraction": ([_tensor("user_id", [3]), _tensor("candidates", [5.5])],
                          {"user_id": 3, "candidates": [5.5]}),
        "shape string": ([_tensor("user_id", [3], shape=["1"]), _tensor("candidates", [5])],
                         None),
        "shape true": ([_tensor("user_id", [3], shape=[True]), _tensor("candidates", [5])],
                       None),
    }

    Answers = dict[str, tuple[httpx.Response, httpx.Response | None]]

    async def body(client: httpx.AsyncClient) -> tuple[Answers, bool, list[httpx.Response]]:
        before = await service.fingerprint()
        answers: Answers = {}
        for case, (inputs, v1) in refused.items():
            kserve = await client.post(infer, json={"inputs": inputs})
            answers[case] = (kserve, None if v1 is None else await client.post("/v1/rank",
                                                                               json=v1))
        unchanged = before == await service.fingerprint()
        accepted = [await client.post(infer, json={"inputs": [
                        _tensor("user_id", [3.0], shape=[1.0]), _tensor("candidates", [5.0, 9])]}),
                    await client.post(infer, json={"inputs": [
                        _tensor("user_id", [3]), _tensor("candidates", [5, 9])]})]
        return answers, unchanged, accepted

    answers, unchanged, (floats, ints) = run_with_client(service, body)
    for case, (kserve, v1) in answers.items():
        assert kserve.status_code == 422, (case, kserve.text)
        assert kserve.json()["error"] == "RequestValidationError", (case, kserve.text)
        assert "expected an integer" in kserve.json()["detail"], (case, kserve.text)
        if v1 is not None:
            assert v1.status_code == 422 and v1.json()["error"] == "RequestValidationError"
    assert unchanged
    assert floats.status_code == 200, floats.text
    assert floats.json()["outputs"][0]["data"] == ints.json()["outputs"][0]["data"] == [5, 9]


def test_kserve_requests_are_counted_and_timed_under_kserve_labels() -> None:
    """KServe's requests are counted by route template (never ``other``, never a model's name)
    and their latencies observed under KServe's own endpoint labels, not /v1's: per-endpoint
    error rates and latencies come out of /metrics."""
    service = make_service()
    name = service.model_info.name
    infer = f"/v2/models/{name}/infer"

    async def body(client: httpx.AsyncClient) -> str:
        ranked = {"inputs": [_tensor("user_id", [3]), _tensor("candidates", [5, 9])]}
        assert (await client.post(infer, json=ranked)).status_code == 200
        cascade = {"inputs": [_tensor("user_id", [4])]}
        assert (await client.post(infer, json=cascade)).status_code == 200
        refused = {"inputs": [{**_tensor("user_id", [4]), "datatype": "FP32"}]}
        assert (await client.post(infer, json=refused)).status_code == 422
        assert (await client.post("/v2/models/another/infer", json=ranked)).status_code == 404
        assert (await client.get(f"/v2/models/{name}/ready")).status_code == 200
        assert (await client.get("/v2/health/live")).status_code == 200
        return (await client.get("/metrics")).text

    got = samples(run_with_client(service, body))
    requests: dict[str, dict[str, float]] = {}
    for (metric, labels), value in got.items():
        if metric == "relaygr_http_requests_total":
            where = dict(labels)
            requests.setdefault(where["endpoint"], {})[where["status"]] = value
    assert requests == {"/v2/models/{name}/infer": {"200": 2.0, "422": 1.0, "404": 1.0},
                        "/v2/models/{name}/ready": {"200": 1.0},
                        "/v2/health/live": {"200": 1.0}}
    timed = {(dict(labels)["endpoint"], dict(labels)["stage"]): value
             for (metric, labels), value in got.items() if metric == "relaygr_stage_seconds_count"}
    assert timed == {("kserve_rank", "ranking"): 1.0, ("kserve_rank", "request"): 1.0,
                     ("kserve_recommend", "earlier_stages"): 1.0,
                     ("kserve_recommend", "retrieval"): 1.0,
                     ("kserve_recommend", "ranking"): 1.0, ("kserve_recommend", "request"): 1.0}


def test_every_route_has_its_own_request_label() -> None:
    """The counter's labels are the routes' declared paths (the documentation's aside)."""
    app = create_app(make_service())
    served = {getattr(route, "path", "") for route in app.routes}
    docs = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    assert served - docs == ENDPOINTS
