"""The dashboard over HTTP (no browser) and the statistics beside it, against the real
database: lists of more endpoints than a page page through all of them, each endpoint's
page has its own health wherever it is in the list, and the delivery-id search goes to a
delivery only."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import psycopg
import pytest
import pytest_asyncio

from tests.support.api import Api, serving

pytestmark = pytest.mark.integration

MANY = 1006  # past the largest page (1000) of any list
LAST = f"ep_{MANY:05d}"
PENDING_OF_LAST = 3


@pytest_asyncio.fixture
async def api(database_url: str) -> AsyncIterator[Api]:
    async with serving(database_url) as running:
        yield running


@pytest_asyncio.fixture
async def many(api: Api, database_url: str) -> Api:
    """``MANY`` endpoints of tenant acme (ids in order: ep_00001 ...), the last with
    pending deliveries."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret)"
            " SELECT 'ep_' || lpad(g::text, 5, '0'), 'acme', 'https://a.example.com/' || g,"
            " 'whsec_' || md5(g::text) FROM generate_series(1, %s) g",
            (MANY,),
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)"
            " SELECT 'acme', 's-' || g, 't', '{}', %s FROM generate_series(1, %s) g",
            (LAST, PENDING_OF_LAST),
        )
    return api


class Browser:
    """A signed-in dashboard session (cookies kept for 127.0.0.1, redirects not followed)."""

    def __init__(self, api: Api, session: aiohttp.ClientSession) -> None:
        self.api = api
        self.session = session

    async def sign_in(self, token: str) -> None:
        async with self.session.get(self.api.url + "/login") as resp:
            nonce = re.search(r'name="nonce" value="([^"]+)"', await resp.text())
        assert nonce is not None
        form = {"token": self.api.tokens[token], "nonce": nonce.group(1)}
        async with self.session.post(
            self.api.url + "/login", data=form, allow_redirects=False
        ) as resp:
            assert resp.status == 303 and resp.headers["location"] == "/", await resp.text()

    async def get(self, path: str) -> tuple[int, str, Any]:
        async with self.session.get(self.api.url + path, allow_redirects=False) as resp:
            return resp.status, await resp.text(), resp.headers


@pytest_asyncio.fixture
async def browser(api: Api) -> AsyncIterator[Browser]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield Browser(api, session)


def pending_shown(html: str, endpoint_id: str) -> int:
    """The pending count the page links to the endpoint's deliveries with."""
    found = re.search(rf'<a href="/deliveries\?endpoint_id={endpoint_id}">(\d+)</a>', html)
    assert found is not None, f"no pending count for {endpoint_id}"
    return int(found.group(1))


async def test_stats_say_their_endpoint_list_is_cut_and_page_through_the_rest(
    many: Api,
) -> None:
    for token in ("admin", "acme"):
        first = await many.get("/api/v1/stats", token=token)
        assert first.status == 200, first.text
        assert len(first.body["endpoints"]) == 1000
        cursor = first.body["endpoints_next_cursor"]
        assert cursor, "a list cut at 1000 must say so"
        rest = await many.get("/api/v1/stats", token=token, params={"endpoints_cursor": cursor})
        assert rest.status == 200, rest.text
        assert rest.body["endpoints_next_cursor"] is None
        ids = [h["id"] for h in first.body["endpoints"] + rest.body["endpoints"]]
        assert ids == [f"ep_{i:05d}" for i in range(1, MANY + 1)]
        assert rest.body["endpoints"][-1]["pending"] == PENDING_OF_LAST
    small = await many.get("/api/v1/stats", params={"endpoints_limit": 2, "tenant": "acme"})
    assert [h["id"] for h in small.body["endpoints"]] == ["ep_00001", "ep_00002"]
    assert small.body["endpoints_next_cursor"] is not None
    # A cursor of another list is refused, as the lists' are.
    wrong = await many.get("/api/v1/endpoints", params={"limit": 1})
    refused = await many.get(
        "/api/v1/stats", params={"endpoints_cursor": wrong.body["next_cursor"]}
    )
    assert refused.status == 400 and refused.error_code == "invalid_cursor"


async def test_the_dashboards_endpoint_list_pages_and_each_page_has_its_own_health(
    many: Api, browser: Browser
) -> None:
    await browser.sign_in("acme")
    seen: list[str] = []
    path: str | None = "/endpoints"
    pages = 0
    while path is not None:
        status, html, _ = await browser.get(path)
        assert status == 200, html
        rows = re.findall(r'<tr data-endpoint="([^"]+)">', html)
        assert 0 < len(rows) <= 50
        seen.extend(rows)
        if LAST in rows:
            assert pending_shown(html, LAST) == PENDING_OF_LAST
        following = re.search(r'<a href="([^"]+)" rel="next"', html)
        path = following.group(1).replace("&amp;", "&") if following else None
        pages += 1
    assert seen == [f"ep_{i:05d}" for i in range(1, MANY + 1)]
    assert pages == -(-MANY // 50)
    # One endpoint's page reads its own health, past the first 1000 too.
    status, html, _ = await browser.get(f"/endpoints/{LAST}")
    assert status == 200, html
    assert pending_shown(html, LAST) == PENDING_OF_LAST


async def test_the_delivery_id_search_goes_to_a_delivery_only(api: Api, browser: Browser) -> None:
    await browser.sign_in("admin")
    status, _, headers = await browser.get("/deliveries?delivery_id=..%2F..%2Flogin")
    assert status == 404 and "location" not in headers
    status, html, _ = await browser.get("/deliveries?delivery_id=..")
    assert status == 404 and "no delivery" in html
    upper = "0A1B2C3D-0000-4000-8000-00000000ABCD"
    status, _, headers = await browser.get(f"/deliveries?delivery_id={upper}")
    assert status == 303 and headers["location"] == f"/deliveries/{upper.lower()}"
