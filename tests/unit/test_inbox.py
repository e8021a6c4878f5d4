"""The inbox's public surface and the parts of it that need no database."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

import fluxora_webhooks.inbox as inbox
from fluxora_webhooks.inbox import InboxEvent
from fluxora_webhooks.inbox._glue import Verification
from fluxora_webhooks.signing import verify, verify_request
from tests.support.dispatch import SECRET
from tests.support.inbox import delivery


def test_the_inbox_namespace_is_locked() -> None:
    assert sorted(inbox.__all__) == [
        "DEFAULT_PRUNE_BATCH",
        "Headers",
        "InboxEvent",
        "InboxPruneResult",
        "Installed",
        "TransactionAborted",
        "check_committable",
        "install",
        "install_report",
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


def test_the_core_imports_no_web_framework() -> None:
    code = (
        "import sys, fluxora_webhooks, fluxora_webhooks.inbox, fluxora_webhooks.inbox.aiohttp\n"
        "loaded = sorted(m for m in ('starlette', 'fastapi', 'django', 'uvicorn')"
        " if m in sys.modules)\n"
        "print(','.join(loaded))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""


def test_verify_request_is_verify_with_what_it_read() -> None:
    d = delivery(attempt=3)
    found = verify_request(d.body, d.headers, SECRET)
    assert found.delivery_id == verify(d.body, d.headers, SECRET) == d.delivery_id
    assert found.scheme == "standard"
    assert found.headers["x-fluxora-attempt"] == "3"
    assert verify_request(d.body, d.fluxora_only(), SECRET).scheme == "fluxora"


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"secret": ""}, ValueError),
        ({"secret": 5}, TypeError),
        ({"secret": "s" * 30, "scheme": "other"}, ValueError),
        ({"secret": "s" * 30, "tolerance_s": -1}, ValueError),
        ({"secret": "s" * 30, "previous_secret": b""}, ValueError),
        ({"secret": "whsec_" + "A" * 43}, ValueError),  # unpadded base64: the sender refuses it
    ],
)
def test_glue_set_up_mistakes_fail_when_the_app_is_built(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        Verification(**kwargs)  # type: ignore[arg-type]


def test_raw_header_pairs_keep_the_first_occurrence_of_each_name() -> None:
    pairs = [(b"webhook-id", b"first"), (b"Webhook-Id", b"second"), (b"webhook-id", b"third")]
    mapping = inbox._header_mapping(pairs)
    found: list[Any] = list(mapping.items())
    assert found == [(b"webhook-id", b"first"), (b"Webhook-Id", b"second")]
    assert inbox._header_mapping({"a": "b"}) == {"a": "b"}
    assert inbox._header_mapping([("only-one",), 5]) == {}  # type: ignore[list-item]


def test_the_asgi_endpoint_refuses_a_body_limit_below_one_byte() -> None:
    from fluxora_webhooks.inbox.asgi import inbox_endpoint

    async def handler(*_: object) -> None:
        return None

    for limit, error in ((0, ValueError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(error):
            inbox_endpoint(lambda: None, handler, secret="s" * 30, max_body_bytes=limit)  # type: ignore[arg-type, return-value]
