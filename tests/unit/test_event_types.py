"""An endpoint's event types (SPEC 10): what is refused says what is wrong with it."""

from __future__ import annotations

import pytest

from fluxora_webhooks.endpoints import check_event_type, check_event_types
from fluxora_webhooks.errors import ConfigError


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        ([], "must list at least one event type"),
        (["a", "a"], "lists 'a' more than once"),
        (["a", "b", " a "], "lists 'a' more than once"),
        (["a", " "], "holds an empty event type"),
        (["a", ""], "holds an empty event type"),
        (["a", 5], "holds int where an event type goes"),
        (["a b"], "'a b' is not an event type"),
        ("a", "must be a list of event types"),
    ],
)
def test_a_refused_list_names_its_fault(patterns: object, message: str) -> None:
    with pytest.raises(ConfigError, match="event_types") as caught:
        check_event_types(patterns)  # type: ignore[arg-type]
    assert message in str(caught.value)


def test_accepted_lists_are_trimmed_in_order() -> None:
    assert check_event_types([" stream.* ", "invoice.paid", "*"]) == (
        "stream.*",
        "invoice.paid",
        "*",
    )


@pytest.mark.parametrize("value", ["", "caf\u00e9", "a\tb", "a\nb", "x" * 201])
def test_an_event_type_no_header_can_carry_as_it_is_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="is not an event type") as caught:
        check_event_type(value)
    assert caught.value.variable == "event_type"


@pytest.mark.parametrize("value", ["invoice.paid", "order.paid now", "*", "x" * 200])
def test_an_event_type_a_header_carries_is_taken(value: str) -> None:
    """Spaces and * included: `*` and prefix filters (order.*) receive such types."""
    assert check_event_type(value) == value
