"""What ``tail`` prints of an attempt: the operator endpoint's events belong to no tenant,
and say so as the API does (``null``), not with the registry's internal marker."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fluxora_webhooks.endpoints import OPERATOR_TENANT
from fluxora_webhooks.tooling import _attempt


def row(tenant: str) -> dict[str, Any]:
    return {
        "id": 7,
        "processed_at": datetime(2026, 12, 4, tzinfo=UTC),
        "delivery_id": "d-1",
        "tenant": tenant,
        "endpoint_id": "operator",
        "event_type": "endpoint.disabled",
        "stream_id": "ep_1",
        "attempt": 1,
        "outcome": "delivered",
        "status_code": 200,
        "duration_ms": 1.234,
        "error": None,
    }


def test_an_operator_attempt_has_no_tenant_and_a_tenants_keeps_its_own() -> None:
    assert _attempt(row(OPERATOR_TENANT)).as_json()["tenant"] is None
    assert _attempt(row("acme")).as_json()["tenant"] == "acme"
    assert _attempt(row("")).as_json()["tenant"] == ""  # the default tenant
