"""/openapi.json describes every route, and real responses match the models it names."""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.http.job_state_views import JOB_ROUTES
from gateway.http.models import Problem
from gateway.http.views import ROUTES as CORE_ROUTES
from tests.conftest import Gateway

ROUTES = (*CORE_ROUTES, *JOB_ROUTES)


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [
            r for v in node.values() for r in refs(v)
        ]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


async def test_document_covers_every_route(gw: Gateway) -> None:
    doc = await (await gw.client.get("/openapi.json")).json()
    assert doc["openapi"] == "3.1.0"
    for route in ROUTES:
        op = doc["paths"][route.path][route.method.lower()]
        assert op["responses"], route.path
    schemas = doc["components"]["schemas"]
    for ref in refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref
    effect = doc["paths"]["/v1/jobs/{job}/effects/{step}"]["post"]
    names = {p["name"] for p in effect["parameters"]}
    assert {"job", "step", "Fencing-Token", "Worker-Id"} <= names
    assert {"200", "409", "422", "424", "502", "503", "504"} <= set(effect["responses"])


async def test_responses_match_their_declared_models(gw: Gateway) -> None:
    by_path = {(r.method, r.path): r for r in ROUTES}

    def route_for(method: str, path: str) -> Any:
        for (m, template), route in by_path.items():
            pattern = "^" + re.sub(r"{\w+}", "[^/]+", template) + "$"
            if m == method and re.match(pattern, path):
                return route
        raise AssertionError(path)

    calls = [
        ("POST", "/v1/jobs/r/generations", {"generation": 2, "lease_ms": 5000}, {}),
        ("POST", "/v1/jobs/r/fence", None, {"Fencing-Token": "2"}),
        (
            "POST",
            "/v1/jobs/r/effects/s",
            {"adapter": "hook", "operation": "x", "payload": {}},
            {"Fencing-Token": "2"},
        ),
        (
            "POST",
            "/v1/jobs/r/effects/s",
            {"adapter": "hook", "operation": "x", "payload": {}},
            {"Fencing-Token": "1"},
        ),
        ("GET", "/v1/jobs/r/effects/s", None, {}),
        ("PUT", "/v1/jobs/r/checkpoints/c", {"n": 1}, {"Fencing-Token": "2"}),
        ("PUT", "/v1/jobs/r/checkpoints/c", {"n": 0}, {"Fencing-Token": "1"}),
        ("GET", "/v1/jobs/r/checkpoints/c", None, {}),
        ("GET", "/v1/jobs/r/checkpoints/none", None, {}),
        ("GET", "/v1/jobs/r/checkpoints", None, {}),
        ("POST", "/v1/jobs/r/complete", {"outputs": ["x"]}, {"Fencing-Token": "2"}),
        ("POST", "/v1/jobs/r/complete", {"result": {"ok": 1}}, {"Fencing-Token": "2"}),
        ("POST", "/v1/jobs/r/complete", {"result": {"ok": 1}}, {"Fencing-Token": "2"}),
        ("GET", "/v1/jobs/r", None, {}),
        ("GET", "/v1/audit/rejections", None, {}),
        ("POST", "/v1/jobs/r/cancel", None, {}),
        ("GET", "/healthz", None, {}),
        ("GET", "/readyz", None, {}),
    ]
    for method, path, body, headers in calls:
        resp = await gw.client.request(method, path, json=body, headers=headers)
        data = json.loads(await resp.read())
        route = route_for(method, path)
        if resp.status >= 400:
            assert resp.status in route.problems, (path, resp.status)
            Problem.model_validate(data)
        else:
            model = route.responses[resp.status]
            assert model is not None
            model.model_validate(data)
