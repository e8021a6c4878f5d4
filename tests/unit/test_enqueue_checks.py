"""enqueue's limits are the API's: the same stream id and event type lengths as
``POST /api/v1/events`` takes, and the same event types as ``check_event_type``."""

from __future__ import annotations

import pytest

from fluxora_webhooks.api.models import EventIn
from fluxora_webhooks.endpoints import check_event_type
from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.outbox import EVENT_TYPE, MAX_EVENT_TYPE, MAX_STREAM_ID


def _max_length(field: str) -> int:
    metadata = EventIn.model_fields[field].metadata
    return next(int(m.max_length) for m in metadata if hasattr(m, "max_length"))


def test_the_lengths_are_the_apis() -> None:
    assert _max_length("stream_id") == MAX_STREAM_ID
    assert _max_length("event_type") == MAX_EVENT_TYPE


@pytest.mark.parametrize(
    "event_type",
    ["stream.paused", " ", "~", "x" * 200, "x" * 201, "", "caf\u00e9", "a\tb", "a\x7fb", "a\x00"],
)
def test_the_event_types_are_the_apis(event_type: str) -> None:
    try:
        check_event_type(event_type)
    except ConfigError:
        taken = False
    else:
        taken = True
    assert bool(EVENT_TYPE.fullmatch(event_type)) is taken
