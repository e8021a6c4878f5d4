"""Property tests: ``inbox.receive`` accepts exactly the requests ``verify`` accepts, refuses
the others with the same reason, and records a delivery id only when it accepts.

Each example runs in a transaction that is rolled back, on a real PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from fluxora_webhooks.errors import VerificationError
from fluxora_webhooks.inbox import receive
from fluxora_webhooks.signing import Signer, verify

pytestmark = pytest.mark.integration

NOW = 1_800_000_000
CURRENT = b"consumer-current-secret-0123456789"
PREVIOUS = b"consumer-previous-secret-012345678"
STRANGER = b"some-other-senders-secret-01234567"
SIGNED = ("webhook-id", "webhook-timestamp", "webhook-signature")
FLUXORA = ("x-fluxora-delivery-id", "x-fluxora-timestamp", "x-fluxora-signature")
PROPERTY = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
# Letters, digits, punctuation, symbols: printable, no surrounding space (verify strips it).
delivery_ids = st.text(
    alphabet=st.characters(categories=["L", "N", "P", "S"]), min_size=1, max_size=40
)
header_values = st.one_of(
    st.text(max_size=60),
    st.integers(min_value=NOW - 1000, max_value=NOW + 1000).map(str),
    st.from_regex(r"v1,[A-Za-z0-9+/=]{0,60}", fullmatch=True),
    st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
    st.none(),  # None: the header is removed
)


@pytest.fixture
def conn(inbox_database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(inbox_database_url) as connection:
        yield connection


def outcome(call: Any) -> tuple[str, str]:
    try:
        result = call()
    except VerificationError as exc:
        return ("refused", exc.reason)
    return ("accepted", result if isinstance(result, str) else result.delivery_id)


def form(headers: dict[str, str], shape: str) -> Any:
    if shape == "multidict":
        return CIMultiDict(headers)
    if shape == "raw pairs":
        return [(k.encode(), v.encode("utf-8", "surrogateescape")) for k, v in headers.items()]
    return headers


@PROPERTY
@given(
    payload=json_values,
    delivery_id=delivery_ids,
    signed_with=st.sampled_from([CURRENT, PREVIOUS, STRANGER]),
    sender_previous=st.sampled_from([None, PREVIOUS]),
    previous=st.sampled_from([None, PREVIOUS]),
    skew=st.integers(min_value=-400, max_value=400),
    tolerance=st.sampled_from([0, 30, 300]),
    scheme=st.sampled_from(["auto", "standard", "fluxora"]),
    keep=st.sampled_from(["both", "standard", "fluxora"]),
    changes=st.dictionaries(st.sampled_from(SIGNED + FLUXORA), header_values, max_size=2),
    tamper=st.booleans(),
    shape=st.sampled_from(["dict", "multidict", "raw pairs"]),
)
def test_receive_accepts_what_verify_accepts_and_refuses_for_the_same_reason(
    conn: psycopg.Connection[Any],
    payload: Any,
    delivery_id: str,
    signed_with: bytes,
    sender_previous: bytes | None,
    previous: bytes | None,
    skew: int,
    tolerance: int,
    scheme: str,
    keep: str,
    changes: dict[str, str | None],
    tamper: bool,
    shape: str,
) -> None:
    body = json.dumps(payload).encode()
    headers = Signer(signed_with, sender_previous).headers(
        delivery_id=delivery_id, event_type="e", attempt=1, body=body, timestamp=NOW + skew
    )
    if keep != "both":
        drop = "x-fluxora-" if keep == "standard" else "webhook-"
        headers = {k: v for k, v in headers.items() if not k.startswith(drop)}
    for name, value in changes.items():
        if value is None:
            headers.pop(name, None)
        else:
            headers[name] = value
    if tamper:
        body = json.dumps([payload]).encode()  # still JSON, no longer what was signed
    options: dict[str, Any] = {"tolerance": tolerance, "now": NOW, "scheme": scheme}
    expected = outcome(lambda: verify(body, headers, CURRENT, previous=previous, **options))
    with conn.transaction(force_rollback=True):
        got = outcome(
            lambda: receive(
                conn,
                body=body,
                headers=form(headers, shape),
                secret=CURRENT,
                previous_secret=previous,
                tolerance_s=tolerance,
                now=NOW,
                scheme=scheme,
            )
        )
        event(f"{got[0]} {got[1] if got[0] == 'refused' else ''}")
        assert got == expected
        row = conn.execute("SELECT count(*) FROM webhook_inbox").fetchone()
        assert row is not None and row[0] == (1 if got[0] == "accepted" else 0)


@PROPERTY
@given(
    payload=json_values,
    delivery_id=delivery_ids,
    skew=st.integers(min_value=-300, max_value=300),
    keep=st.sampled_from(["both", "standard", "fluxora"]),
    attempt=st.integers(min_value=1, max_value=10**6),
)
def test_a_genuine_delivery_is_received_once_with_its_payload(
    conn: psycopg.Connection[Any],
    payload: Any,
    delivery_id: str,
    skew: int,
    keep: str,
    attempt: int,
) -> None:
    body = json.dumps(payload).encode()
    headers = Signer(CURRENT).headers(
        delivery_id=delivery_id, event_type="e.t", attempt=attempt, body=body, timestamp=NOW + skew
    )
    if keep != "both":
        drop = "x-fluxora-" if keep == "standard" else "webhook-"
        headers = {k: v for k, v in headers.items() if not k.startswith(drop)}
    kwargs: dict[str, Any] = {"body": body, "headers": headers, "secret": CURRENT, "now": NOW}
    with conn.transaction(force_rollback=True):
        event = receive(conn, **kwargs)
        assert event is not None
        assert event.delivery_id == delivery_id
        assert event.payload == payload
        expected_meta = (None, None) if keep == "standard" else ("e.t", attempt)
        assert (event.event_type, event.attempt) == expected_meta
        assert receive(conn, **kwargs) is None
