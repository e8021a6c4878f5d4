"""Paging the lists as a syncing client does, while the system is busy: a real dispatcher
delivers to loopback receivers (one answering 200, one 500), a producer commits events
and endpoints are added, disabled and removed during the walk. Every item committed before
a walk and still there after it is seen exactly once, in the list's strict order; a
cursor positions only (a tenant's token following an admin's cursor sees its own items);
a full page of the largest size ends the list with a null cursor; bad limits and cursors
are 4xx in the error shape."""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
import pytest_asyncio

from tests.support.api import LOOPBACK, Api
from tests.support.dispatch import make_settings, running_dispatcher
from tests.support.receiver import Receiver, answering

pytestmark = pytest.mark.integration

KEY = {"events": "id", "deliveries": "delivery_id", "endpoints": "id"}
TENANT_OF = {"acme": "acme", "bolt": "bolt", "default": ""}


@pytest_asyncio.fixture
async def failing() -> AsyncIterator[Receiver]:
    async with answering(500, "down") as recv:
        yield recv


async def add_endpoint(api: Api, url: str, tenant: str) -> str:
    reply = await api.post("/api/v1/endpoints", json={"url": url, "tenant": tenant})
    assert reply.status == 201, reply.text
    return str(reply.body["id"])


async def committed(database_url: str, kind: str, tenant: str | None) -> dict[str, int]:
    """The items of a list committed now, read straight from the tables, each with the key
    the list is ordered by."""
    where, args = "", [] if tenant is None else [tenant]
    if kind == "events":
        sql = (
            "SELECT id::text, id FROM webhook_outbox"
            " WHERE event_id IS NULL AND tenant <> '!operator'"
        )
    elif kind == "deliveries":
        sql = (
            "SELECT delivery_id::text, id FROM webhook_outbox WHERE attempt = 1 AND NOT replay"
            " AND endpoint_id IS NOT NULL AND outcome IS DISTINCT FROM 'routed'"
            " AND outcome IS DISTINCT FROM 'unrouted'"
        )
    else:
        # the rank in the database's own order (its collation)
        sql = "SELECT id, rank() OVER (ORDER BY id) FROM webhook_endpoints WHERE true"
    if tenant is not None:
        where = " AND tenant = %s"
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        rows = await (await conn.execute(sql + where, args)).fetchall()
    return {str(k): v for k, v in rows}


async def walk(api: Api, kind: str, token: str, limit: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    for _ in range(10_000):
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        reply = await api.get(f"/api/v1/{kind}", token=token, params=params)
        assert reply.status == 200, reply.text
        assert set(reply.body) == {"data", "next_cursor"}
        assert len(reply.body["data"]) <= limit
        items.extend(reply.body["data"])
        cursor = reply.body["next_cursor"]
        if cursor is None:
            return items
        await asyncio.sleep(0.005)  # let the writers write between pages
    raise AssertionError("the walk did not end")


async def produce(database_url: str, stop: asyncio.Event, tenants: list[str]) -> int:
    made = 0
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        while not stop.is_set() and made < 600:
            async with conn.transaction():
                for i in range(3):
                    await conn.execute(
                        "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                        " VALUES (%s, %s, 'a.b', '{}')",
                        (tenants[made % len(tenants)], f"s{(made + i) % 7}"),
                    )
            made += 3
            await asyncio.sleep(0.01)
    return made


async def churn(api: Api, stop: asyncio.Event, urls: list[str]) -> None:
    """Endpoints added, disabled, enabled and removed while the walks run."""
    turn = 0
    while not stop.is_set() and turn < 200:
        tenant = ["acme", "bolt", ""][turn % 3]
        created = await add_endpoint(api, urls[turn % len(urls)], tenant)
        if turn % 2:
            reply = await api.post(f"/api/v1/endpoints/{created}/disable")
            assert reply.status == 200, reply.text
        if turn % 3 == 2:
            reply = await api.call("DELETE", f"/api/v1/endpoints/{created}")
            assert reply.status == 204, reply.text
        turn += 1
        await asyncio.sleep(0.05)


async def test_walks_under_writes_see_each_item_before_them_once_in_order(
    api: Api, database_url: str, receiver: Receiver, failing: Receiver
) -> None:
    urls = [receiver.url, failing.url]
    for tenant in ("acme", "bolt", ""):
        for url in urls:
            await add_endpoint(api, url, tenant)
    settings = dataclasses.replace(
        make_settings("", allowed_networks=LOOPBACK, secret=b""), max_attempts=2
    )
    stop = asyncio.Event()
    async with running_dispatcher(settings, database_url):
        writers = [
            asyncio.create_task(produce(database_url, stop, ["acme", "bolt", ""])),
            asyncio.create_task(churn(api, stop, urls)),
        ]
        try:
            await receiver.wait_for(10)
            for kind in ("events", "deliveries", "endpoints"):
                for token, limit in (("admin", 7), ("acme", 3), ("default", 50)):
                    scope = TENANT_OF.get(token)
                    before = await committed(database_url, kind, scope)
                    items = await walk(api, kind, token, limit)
                    after = await committed(database_url, kind, scope)
                    seen = collections.Counter(str(i[KEY[kind]]) for i in items)
                    assert not [k for k, n in seen.items() if n > 1], (kind, token)
                    missing = (before.keys() & after.keys()) - seen.keys()
                    assert not missing, (kind, token, len(missing), len(before))
                    if scope is not None:
                        assert {i["tenant"] for i in items} <= {scope}, (kind, token)
                    keys = [after.get(str(i[KEY[kind]])) for i in items]
                    known = [k for k in keys if k is not None]  # removed meanwhile: unknown
                    expected = sorted(known, reverse=kind != "endpoints")
                    assert known == expected and len(set(known)) == len(known), (kind, token)
        finally:
            stop.set()
            await asyncio.gather(*writers)


async def test_a_tenant_following_an_admin_cursor_sees_only_its_own(
    api: Api, database_url: str
) -> None:
    for n in range(6):
        for tenant in ("acme", "bolt"):
            reply = await api.post(
                "/api/v1/events",
                json={"tenant": tenant, "stream_id": f"s{n}", "event_type": "a.b", "payload": n},
            )
            assert reply.status == 202, reply.text
        await add_endpoint(api, "http://127.0.0.1:9/x", "bolt" if n % 2 else "acme")
    cursor: str | None
    for kind in ("events", "endpoints"):
        # the admin's walk, one item a page: after each of its cursors, the acme token
        # reads exactly the acme items the admin's walk has after that position
        every, cursors = [], []
        cursor = None
        while True:
            params = {"limit": 1, **({"cursor": cursor} if cursor else {})}
            reply = await api.get(f"/api/v1/{kind}", params=params)
            assert reply.status == 200, reply.text
            every += reply.body["data"]
            cursor = reply.body["next_cursor"]
            if cursor is None:
                break
            cursors.append(cursor)
        assert {i["tenant"] for i in every} == {"acme", "bolt"}
        for n, cursor in enumerate(cursors):
            reply = await api.get(
                f"/api/v1/{kind}", token="acme", params={"limit": 1000, "cursor": cursor}
            )
            assert reply.status == 200, reply.text
            wanted = [i for i in every[n + 1 :] if i["tenant"] == "acme"]
            assert reply.body["data"] == wanted, (kind, n)
        # and a forged key reveals no other tenant's item either
        forged = encode(kind, "0" if kind == "events" else "a")
        reply = await api.get(f"/api/v1/{kind}", token="acme", params={"cursor": forged})
        assert reply.status == 200 and {i["tenant"] for i in reply.body["data"]} <= {"acme"}


def encode(kind: str, key: str) -> str:
    return base64.urlsafe_b64encode(f"{kind}:{key}".encode()).decode().rstrip("=")


async def test_a_full_page_of_the_largest_size_ends_the_endpoints_with_null(
    api: Api, database_url: str
) -> None:
    """1000 endpoints of a tenant in one page of 1000: no cursor to an empty page (the
    events and deliveries end the same way)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url)"
            " SELECT 'ep_wide' || lpad(n::text, 4, '0'), 'wide', 'http://127.0.0.1:9/x'"
            " FROM generate_series(1, 1000) n"
        )
    reply = await api.get("/api/v1/endpoints", params={"tenant": "wide", "limit": 1000})
    assert reply.status == 200, reply.text
    assert len(reply.body["data"]) == 1000
    assert reply.body["next_cursor"] is None
    # one more: the page of 1000 now has a next one, holding it
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url)"
            " VALUES ('ep_wide9999', 'wide', 'http://127.0.0.1:9/x')"
        )
    reply = await api.get("/api/v1/endpoints", params={"tenant": "wide", "limit": 1000})
    assert reply.status == 200 and reply.body["next_cursor"], reply.text
    more = await api.get(
        "/api/v1/endpoints",
        params={"tenant": "wide", "limit": 1000, "cursor": reply.body["next_cursor"]},
    )
    assert [e["id"] for e in more.body["data"]] == ["ep_wide9999"]
    assert more.body["next_cursor"] is None


@pytest.mark.parametrize("kind", ["events", "deliveries", "endpoints"])
async def test_bad_limits_and_cursors_are_4xx_in_the_error_shape(api: Api, kind: str) -> None:
    for limit in ("0", "-1", "1001", "1.5", "x", "99999999999999999999"):
        reply = await api.get(f"/api/v1/{kind}", params={"limit": limit})
        assert reply.status == 422 and reply.error_code == "validation_error", (limit, reply)
    for good in ("1", "1000"):
        assert (await api.get(f"/api/v1/{kind}", params={"limit": good})).status == 200
    other = "events" if kind != "events" else "deliveries"
    cursors = [
        "%%%",
        "a",
        "not base64 !",
        encode(other, "5"),  # another list's
        encode("endpoint_health", "ep_x"),  # the statistics' own list
        base64.b64encode(f"{kind}:\x00".encode()).decode(),  # a NUL
        base64.b64encode(f"{kind}:".encode()).decode(),  # no key
    ]
    if kind != "endpoints":  # keys of bigint lists: digits that fit
        cursors += [encode(kind, "-1"), encode(kind, "9" * 20), encode(kind, "\uff11\uff12")]
    for cursor in cursors:
        reply = await api.get(f"/api/v1/{kind}", params={"cursor": cursor})
        assert reply.status == 400 and reply.error_code == "invalid_cursor", (cursor, reply)
    reply = await api.get(f"/api/v1/{kind}", params={"cursor": ""})  # the first page
    assert reply.status == 200, reply.text
