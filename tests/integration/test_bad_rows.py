"""Rows written by SQL past the checks of the CLI and the API: one bad row never stops the
others. An outbox row due at a time Python cannot hold is sent like any other; an
endpoint whose row cannot be used has its deliveries dead-lettered naming why, while every
other endpoint keeps receiving, and is sent to again once its row is fixed."""

from __future__ import annotations

import json
import secrets

import psycopg
import pytest

from fluxora_webhooks import deliveries
from tests.support.api import LOOPBACK, serving
from tests.support.dispatch import make_settings, rows, running_dispatcher, wait_until
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

SECRET = "whsec_" + "A" * 43 + "="


async def test_due_times_out_of_pythons_range_are_sent_and_stop_nothing(
    database_url: str, receiver: Receiver
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for n, due in enumerate(("-infinity", "0044-03-15 BC", "1900-01-01")):
            await conn.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at)"
                " VALUES ('odd', 'odd.due', jsonb_build_object('n', %s::int), %s)",
                (n, due),
            )
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " SELECT 'fine', 'fine.due', jsonb_build_object('n', g) FROM generate_series(3, 7) g"
        )
    async with running_dispatcher(make_settings(receiver.url), database_url):
        await receiver.wait_for(8)
    assert sorted(json.loads(hit.body)["n"] for hit in receiver.received) == list(range(8))
    # The API reads them too (each list was a 500).
    async with serving(database_url) as api:
        for path in ("/api/v1/deliveries", "/api/v1/events"):
            listed = await api.get(path, params={"stream_id": "odd"})
            assert listed.status == 200 and len(listed.body["data"]) == 3, path


async def test_an_unusable_endpoint_row_dead_letters_its_deliveries_naming_why(
    database_url: str, receiver: Receiver
) -> None:
    bad = {
        "ep_int_header": ("h1", receiver.url, SECRET, '{"X-Api-Key": 12345}'),
        "ep_list_headers": ("h2", receiver.url, SECRET, "[1, 2]"),
        "ep_no_secret": ("h3", receiver.url, None, "{}"),
        "ep_ftp": ("h4", "ftp://127.0.0.1/t", SECRET, "{}"),
        "ep_credentials": ("h5", receiver.url.replace("//", "//user:pw@"), SECRET, "{}"),
        "ep_empty_key": ("h6", receiver.url, "whsec_", "{}"),  # no key once decoded
    }
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for endpoint_id, (tenant, url, secret, headers) in bad.items():
            await conn.execute(
                "INSERT INTO webhook_endpoints (id, tenant, url, secret, headers)"
                " VALUES (%s, %s, %s, %s, %s::jsonb)",
                (endpoint_id, tenant, url, secret, headers),
            )
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret)"
            " VALUES ('ep_ok', 'ok', %s, %s)",
            (receiver.url, SECRET),
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            " SELECT t, 's', 'e', jsonb_build_object('t', t)"
            " FROM unnest(ARRAY['h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'ok', 'ok', 'ok']) t"
        )
    settings = make_settings("", allowed_networks=LOOPBACK)

    async def all_done() -> bool:
        left = await rows(database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed")
        return left == [(0,)]

    async with running_dispatcher(settings, database_url):
        await wait_until(all_done, what="every delivery done")
        assert [json.loads(hit.body)["t"] for hit in receiver.received] == ["ok"] * 3
        dead = dict(
            await rows(
                database_url,
                "SELECT o.endpoint_id, d.reason || ': ' || d.last_error"
                " FROM webhook_dead_letter d JOIN webhook_outbox o USING (delivery_id)"
                " WHERE o.outcome = 'dead_letter'",
            )
        )
        assert set(dead) == set(bad)
        assert all(text.startswith("invalid_request: endpoint ") for text in dead.values())
        assert "X-Api-Key must be text" in dead["ep_int_header"]
        assert "headers" in dead["ep_list_headers"]
        assert "no secret" in dead["ep_no_secret"]
        assert "scheme 'ftp' is not allowed" in dead["ep_ftp"]
        assert "credentials" in dead["ep_credentials"] and "pw" not in dead["ep_credentials"]
        assert "signing secret is empty" in dead["ep_empty_key"]
        # No request was made: no attempt counted (as `endpoints remove` counts none), by
        # the dead letters and by the API's view of the delivery alike.
        assert await rows(database_url, "SELECT DISTINCT attempts FROM webhook_dead_letter") == [
            (0,)
        ]
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            ((delivery_id,),) = await rows(
                database_url, "SELECT delivery_id::text FROM webhook_dead_letter LIMIT 1"
            )
            shown = await deliveries.get_delivery(conn, delivery_id)
        assert (shown["attempt_count"], shown["attempts"]) == (0, []), shown
        # Fixed, the endpoint is sent to again (its row's change reloads it).
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(
                """UPDATE webhook_endpoints SET headers = '{"X-Api-Key": "12345"}'"""
                " WHERE id = 'ep_int_header'"
            )
            await conn.execute(
                "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                """ VALUES ('h1', 's', 'e', '{"t": "h1 fixed"}')"""
            )
        await receiver.wait_for(4)
    assert json.loads(receiver.received[3].body) == {"t": "h1 fixed"}
    assert receiver.received[3].headers["x-api-key"] == "12345"


async def test_the_api_lists_an_endpoint_whose_headers_sql_wrote_badly(database_url: str) -> None:
    """One such row broke its tenant's whole list (a 500): its headers read as text."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for endpoint_id, headers in (("ep_list", "[1, 2]"), ("ep_number", '{"X-Part": 5}')):
            await conn.execute(
                "INSERT INTO webhook_endpoints (id, tenant, url, secret, headers)"
                " VALUES (%s, 't', 'https://a.example.com/', %s, %s::jsonb)",
                (endpoint_id, SECRET, headers),
            )
    async with serving(database_url) as api:
        listed = await api.get("/api/v1/endpoints", params={"tenant": "t"})
        assert listed.status == 200
        assert {e["id"]: e["headers"] for e in listed.body["data"]} == {
            "ep_list": {},
            "ep_number": {"X-Part": "5"},
        }
        assert (await api.get("/api/v1/endpoints/ep_number")).status == 200


async def test_a_stream_id_too_long_for_an_ordered_endpoints_index_stops_nothing(
    database_url: str, receiver: Receiver
) -> None:
    # Written by SQL (enqueue and the API refuse it): the event row fits its own indexes,
    # its ordered endpoint's delivery does not fit the stream index. Refused for what it
    # holds, the routing was taken for a database outage: every claim loop retried that
    # batch for ever and nothing more was delivered, to any tenant.
    stream_id = secrets.token_hex(1340)  # 2,680 characters that do not compress
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret, ordered)"
            " VALUES ('ep_ordered', 'ord', %s, %s, true), ('ep_plain', 'plain', %s, %s, false)",
            (receiver.url, SECRET, receiver.url, SECRET),
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            """ VALUES ('ord', %s, 'e', '{"n": "long"}')""",
            (stream_id,),
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            " SELECT t, 's', 'e', jsonb_build_object('n', t || g)"
            " FROM unnest(ARRAY['ord', 'plain']) t, generate_series(1, 3) g"
        )
    settings = make_settings("", allowed_networks=LOOPBACK)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(6)

        async def dead_lettered() -> bool:
            return bool(await rows(database_url, "SELECT 1 FROM webhook_dead_letter"))

        await wait_until(dead_lettered, what="the long stream's event dead-lettered")
    assert sorted(json.loads(hit.body)["n"] for hit in receiver.received) == [
        "ord1", "ord2", "ord3", "plain1", "plain2", "plain3"
    ]  # fmt: skip
    ((reason, error, stream),) = await rows(
        database_url, "SELECT reason, last_error, stream_id FROM webhook_dead_letter"
    )
    assert (reason, stream) == ("internal_error", stream_id)
    assert "54000" in error and "webhook_outbox_stream" in error, error


async def test_a_delivery_row_naming_another_tenants_endpoint_is_never_sent_there(
    database_url: str, receiver: Receiver
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret)"
            " VALUES ('ep_bolt', 'bolt', %s, %s)",
            (receiver.url, SECRET),
        )
        await conn.execute(  # acme's event, written straight at bolt's endpoint
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)"
            """ VALUES ('acme', 's', 'e', '{"t": "acme"}', 'ep_bolt'),"""
            """ ('bolt', 's', 'e', '{"t": "bolt"}', 'ep_bolt')"""
        )
    async with running_dispatcher(make_settings("", allowed_networks=LOOPBACK), database_url):
        await receiver.wait_for(1)

        async def dead_lettered() -> bool:
            return bool(await rows(database_url, "SELECT 1 FROM webhook_dead_letter"))

        await wait_until(dead_lettered, what="acme's row dead-lettered")
    assert [json.loads(hit.body)["t"] for hit in receiver.received] == ["bolt"]
    assert await rows(
        database_url, "SELECT tenant, reason, last_error FROM webhook_dead_letter"
    ) == [("acme", "invalid_request", "endpoint ep_bolt is not an endpoint of the row's tenant")]


async def test_a_plain_http_loopback_endpoint_is_sent_to_only_while_the_policy_allows_it(
    database_url: str, receiver: Receiver
) -> None:
    """A registered endpoint's plain-http URL to a loopback address (registered under a
    wider WEBHOOK_ALLOWED_NETWORKS, or written by SQL) is checked at the socket against the
    policy of the dispatcher that sends it: refused while loopback is not allowed (plain
    http is allowed to loopback only, which does not allow loopback), sent once it is."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret)"
            " VALUES ('ep_loop', 'inside', %s, %s)",
            (receiver.url, SECRET),
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            " VALUES ('inside', 's', 'e', '{\"n\": 1}')"
        )

    async def settled() -> bool:
        left = await rows(database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed")
        return left == [(0,)]

    async with running_dispatcher(make_settings(""), database_url):
        await wait_until(settled, what="the delivery settled")
    assert receiver.received == []
    [(reason, error)] = await rows(
        database_url, "SELECT reason, last_error FROM webhook_dead_letter"
    )
    assert reason == "endpoint_refused" and "loopback" in error, (reason, error)

    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            " VALUES ('inside', 's', 'e', '{\"n\": 2}')"
        )
    async with running_dispatcher(make_settings("", allowed_networks=LOOPBACK), database_url):
        await receiver.wait_for(1)
    assert [json.loads(hit.body)["n"] for hit in receiver.received] == [2]
