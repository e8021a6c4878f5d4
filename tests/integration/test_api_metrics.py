"""The API's request series (docs/operations.md, "The management API's series"): every
answer counted by method, route template and status (a 404 for an id, a 405, a 413 and a
429 included), timed, and never labelled with a path, an id or a query."""

from __future__ import annotations

import io

import pytest
from prometheus_client import generate_latest

from fluxora_webhooks import metrics
from fluxora_webhooks.api.app import MAX_BODY_BYTES
from tests.support.api import serving

pytestmark = pytest.mark.integration


def counts() -> dict[tuple[str, str, str], float]:
    """fluxora_api_requests_total by (method, route, status), as this process has them."""
    found: dict[tuple[str, str, str], float] = {}
    for family in metrics.REGISTRY.collect():
        if family.name != "fluxora_api_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = (sample.labels["method"], sample.labels["route"], sample.labels["status"])
                found[key] = sample.value
    return found


def timed(method: str, route: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "fluxora_api_request_duration_seconds_count", {"method": method, "route": route}
    )
    return value or 0.0


async def test_each_answer_is_counted_by_its_route_template_and_status(database_url: str) -> None:
    before = counts()
    timed_before = timed("GET", "/api/v1/endpoints/{endpoint_id}")
    async with serving(database_url, rate_limit=(8, 3_600_000)) as api:
        listed = await api.get("/api/v1/endpoints", token="acme")
        assert listed.status == 200, listed.text
        missing = await api.get("/api/v1/endpoints/ep_secretlookingid", token="acme")
        assert missing.status == 404, missing.text
        unknown = await api.get("/api/v1/no-such-thing?tenant=acme", token="acme")
        assert unknown.status == 404, unknown.text
        wrong_method = await api.call("DELETE", "/api/v1/events", token="acme")
        assert wrong_method.status == 405, wrong_method.text
        head = await api.call("HEAD", "/api/v1/endpoints", token="acme")
        assert head.status == 200
        headers = {"Authorization": f"Bearer {api.tokens['acme']}"}
        big = io.BytesIO(b"x" * (MAX_BODY_BYTES + 1))
        async with api.session.post(api.url + "/api/v1/events", data=big, headers=headers) as r:
            assert r.status == 413
        unauthenticated = await api.get("/api/v1/endpoints", token=None)
        assert unauthenticated.status == 401
        statuses: list[int] = []
        while not statuses or statuses[-1] != 429:
            statuses.append((await api.get("/api/v1/endpoints", token="acme")).status)
            assert len(statuses) < 20, statuses
    after = counts()
    grown = {key: value - before.get(key, 0.0) for key, value in after.items()}
    grown = {key: value for key, value in grown.items() if value}
    assert grown == {
        ("GET", "/api/v1/endpoints", "200"): 1 + len(statuses) - 1,
        ("GET", "/api/v1/endpoints/{endpoint_id}", "404"): 1,
        ("GET", "none", "404"): 1,
        ("DELETE", "/api/v1/events", "405"): 1,
        ("HEAD", "/api/v1/endpoints", "200"): 1,
        ("POST", "/api/v1/events", "413"): 1,
        ("GET", "/api/v1/endpoints", "401"): 1,
        ("GET", "none", "429"): 1,  # refused before routing
    }, grown
    assert timed("GET", "/api/v1/endpoints/{endpoint_id}") == timed_before + 1
    text = "\n".join(
        line
        for line in generate_latest(metrics.REGISTRY).decode().splitlines()
        if line.startswith("fluxora_api_")
    )
    assert "fluxora_api_requests_total{" in text
    assert "ep_secretlookingid" not in text and "no-such-thing" not in text
    assert "tenant" not in text and api.tokens["acme"] not in text


async def test_the_dashboard_and_its_files_are_counted_by_template(database_url: str) -> None:
    before = counts()
    async with serving(database_url) as api:
        page = await api.call("GET", "/login", token=None)
        assert page.status == 200
        style = await api.call("GET", "/static/app.css", token=None)
        assert style.status == 200
        gone = await api.call("GET", "/static/nothing-here.css", token=None)
        assert gone.status == 404
    after = counts()
    grown = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
    assert grown == {
        ("GET", "/login", "200"): 1,
        ("GET", "/static", "200"): 1,
        ("GET", "/static", "404"): 1,
    }, grown
