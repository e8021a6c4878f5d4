"""The inbox's public surface and the parts of it that need no database."""

from __future__ import annotations

import dataclasses

import pytest

import fluxora_webhooks.inbox as inbox
from fluxora_webhooks.inbox import InboxEvent
from fluxora_webhooks.signing import verify, verify_request
from tests.support.dispatch import SECRET
from tests.support.inbox import delivery


def test_the_inbox_namespace_is_locked() -> None:
    assert sorted(inbox.__all__) == [
        "DEFAULT_PRUNE_BATCH",
        "Headers",
        "InboxEvent",
        "InboxPruneResult",
        "install",
        "prune",
        "receive",
    ]
    for name in inbox.__all__:
        assert hasattr(inbox, name), name


def test_the_event_is_a_frozen_dataclass() -> None:
    event = InboxEvent("d-1", "t", 1, {"a": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.delivery_id = "d-2"  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(InboxEvent)] == [
        "delivery_id",
        "event_type",
        "attempt",
        "payload",
    ]


def test_verify_request_is_verify_with_what_it_read() -> None:
    d = delivery(attempt=3)
    found = verify_request(d.body, d.headers, SECRET)
    assert found.delivery_id == verify(d.body, d.headers, SECRET) == d.delivery_id
    assert found.scheme == "standard"
    assert found.headers["x-fluxora-attempt"] == "3"
    assert verify_request(d.body, d.fluxora_only(), SECRET).scheme == "fluxora"


def test_raw_header_pairs_keep_the_first_occurrence_of_each_name() -> None:
    pairs = [(b"webhook-id", b"first"), (b"Webhook-Id", b"second"), (b"webhook-id", b"third")]
    mapping = inbox._header_mapping(pairs)
    assert list(mapping.items()) == [(b"webhook-id", b"first"), (b"Webhook-Id", b"second")]
    assert inbox._header_mapping({"a": "b"}) == {"a": "b"}
    assert inbox._header_mapping([("only-one",), 5]) == {}  # type: ignore[list-item]
