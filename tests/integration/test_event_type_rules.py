"""Event types and the endpoints' filters, as each way in takes them (SPEC 10): enqueue, the
API, ``send``'s check and the dashboard's forms agree on what an event type is, every type
they take reaches the consumer as the type the filters were matched with, and a filter
refused says what is wrong with it."""

from __future__ import annotations

import dataclasses
import html as markup
import ipaddress
from collections.abc import AsyncIterator

import aiohttp
import psycopg
import pytest
import pytest_asyncio

from fluxora_webhooks import endpoints, enqueue
from fluxora_webhooks.endpoints import check_event_type
from fluxora_webhooks.errors import ConfigError
from tests.integration.test_dashboard_portal import Portal
from tests.support.api import Api, serving
from tests.support.dispatch import make_settings, rows, running_dispatcher, scalar, wait_until
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


@pytest_asyncio.fixture
async def api(database_url: str) -> AsyncIterator[Api]:
    async with serving(database_url) as running:
        yield running


@pytest_asyncio.fixture
async def portal(api: Api) -> AsyncIterator[Portal]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield Portal(api, session)


# A header's value loses a space at either end (RFC 9110 5.5): the consumer would read
# "invoice.paid" (or no type at all) for an event no "invoice.paid" filter was matched with.
EDGE_SPACES = [" invoice.paid", "invoice.paid ", " ", "   "]


@pytest.mark.parametrize("event_type", EDGE_SPACES)
async def test_an_event_type_with_a_space_at_either_end_is_refused_by_every_way_in(
    api: Api, database_url: str, event_type: str
) -> None:
    with (
        psycopg.connect(database_url) as conn,
        pytest.raises(ValueError, match="not starting or ending with a space"),
    ):
        enqueue(conn, stream_id="s", event_type=event_type, payload={})
    with pytest.raises(ConfigError, match="not starting or ending with a space"):
        check_event_type(event_type, "--event")  # send's check
    reply = await api.post(
        "/api/v1/events",
        token="acme",
        json={"stream_id": "s", "event_type": event_type, "payload": {}},
    )
    assert reply.status == 422 and reply.error_code == "validation_error", reply.text
    assert "not starting or ending with a space" in reply.body["error"]["message"]
    assert await scalar(database_url, "SELECT count(*) FROM webhook_outbox") == 0


async def test_every_type_taken_reaches_the_consumer_as_the_filters_matched_it(
    api: Api, database_url: str, receiver: Receiver
) -> None:
    """Spaces inside, `*` and the printable range's ends are taken; the consumer's
    x-fluxora-event is the type as enqueued, and the filters match exactly that, case
    included."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        every, _ = await endpoints.create(
            conn, url=receiver.url, tenant="acme", allowed_networks=LOOPBACK
        )
        exact, _ = await endpoints.create(
            conn,
            url=receiver.url,
            tenant="acme",
            event_types=["invoice.paid", "!~"],
            allowed_networks=LOOPBACK,
        )
        prefix, _ = await endpoints.create(
            conn,
            url=receiver.url,
            tenant="acme",
            event_types=["invoice.*"],
            allowed_networks=LOOPBACK,
        )
    sent = ["invoice.paid", "Invoice.Paid", "invoice", "invoice.*", "order paid now", "!~"]
    for event_type in sent:
        reply = await api.post(
            "/api/v1/events",
            token="acme",
            json={"stream_id": "s", "event_type": event_type, "payload": {}},
        )
        assert reply.status == 202, reply.text
    settings = dataclasses.replace(
        make_settings("", allowed_networks=LOOPBACK), secret=b"", retry_schedule_ms=(60_000,)
    )
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(len(sent) + 4)
        await wait_until(lambda: _all_processed(database_url), what="every delivery recorded")
    routed = {
        (endpoint_id, event_type)
        for endpoint_id, event_type in await rows(
            database_url,
            "SELECT endpoint_id, event_type FROM webhook_outbox"
            " WHERE endpoint_id IS NOT NULL AND outcome = 'delivered'",
        )
    }
    assert routed == (
        {(every.id, t) for t in sent}
        | {(exact.id, "invoice.paid"), (exact.id, "!~")}
        | {(prefix.id, "invoice.paid"), (prefix.id, "invoice.*")}
    )
    assert sorted(r.headers["x-fluxora-event"] for r in receiver.received) == sorted(
        [*sent, "invoice.paid", "!~", "invoice.paid", "invoice.*"]
    )


async def _all_processed(database_url: str) -> bool:
    left = await scalar(database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed")
    return int(left) == 0


async def test_a_filter_too_long_says_how_long_it_is(api: Api) -> None:
    for pattern, length in (("x" * 201, 201), ("x" * 201 + "*", 202)):
        reply = await api.post(
            "/api/v1/endpoints",
            json={"url": "https://a.example.com/hook", "tenant": "acme", "event_types": [pattern]},
        )
        assert reply.status == 422, reply.text
        message = reply.body["error"]["message"]
        assert f"is {length} characters" in message and "at most 200" in message, message
    for pattern in ("x" * 200, "x" * 200 + "*"):  # the longest taken
        reply = await api.post(
            "/api/v1/endpoints",
            json={"url": "https://a.example.com/hook", "tenant": "acme", "event_types": [pattern]},
        )
        assert reply.status == 201, reply.text


async def test_emptying_the_event_types_in_the_change_form_is_refused_not_every_type(
    api: Api, portal: Portal, database_url: str
) -> None:
    """A PATCH with no event type is refused; the dashboard's change form with its field
    emptied is too, marked at the field, rather than subscribing the endpoint to `*`."""
    made = await api.post(
        "/api/v1/endpoints",
        json={"url": "https://a.example.com/hook", "tenant": "acme", "event_types": ["invoice.*"]},
    )
    assert made.status == 201, made.text
    endpoint_id = made.body["id"]
    patched = await api.call(
        "PATCH", f"/api/v1/endpoints/{endpoint_id}", token="acme", json={"event_types": []}
    )
    assert patched.status == 422, patched.text

    await portal.sign_in("acme")
    form = {
        "csrf": await portal.csrf(),
        "url": "https://a.example.com/hook",
        "event_types": " , ",
        "description": "",
        "headers": "",
        "rate_limit": "",
    }
    status, html, _ = await portal.post(f"/endpoints/{endpoint_id}/edit", form)
    assert status == 422, html
    assert "must list at least one event type" in markup.unescape(html)
    stored = await scalar(
        database_url, "SELECT event_types FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
    )
    assert stored == ["invoice.*"]

    form["event_types"] = "invoice.paid, refund.*"  # still changed as typed
    status, html, _ = await portal.post(f"/endpoints/{endpoint_id}/edit", form)
    assert status == 303, html
    stored = await scalar(
        database_url, "SELECT event_types FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
    )
    assert stored == ["invoice.paid", "refund.*"]
