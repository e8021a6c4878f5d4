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

    async def post(self, path: str, form: dict[str, str]) -> tuple[int, str, Any]:
        """A form of the dashboard, with the session's CSRF token (from its pages)."""
        _, html, _ = await self.get("/deliveries")
        csrf = re.search(r'name="csrf" value="([^"]+)"', html)
        assert csrf is not None, html
        async with self.session.post(
            self.api.url + path, data={"csrf": csrf.group(1), **form}, allow_redirects=False
        ) as resp:
            return resp.status, await resp.text(), resp.headers


@pytest_asyncio.fixture
async def browser(api: Api) -> AsyncIterator[Browser]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield Browser(api, session)


def pending_shown(html: str, endpoint_id: str) -> int:
    """The pending count the page links to the endpoint's deliveries with (its words for
    a screen reader after it)."""
    found = re.search(rf'<a href="/deliveries\?endpoint_id={endpoint_id}">(\d+)<', html)
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
        rows = re.findall(r'<tr data-endpoint="([^"]+)"', html)
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


async def one_endpoint(database_url: str, endpoint_id: str = "ep_one") -> str:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret)"
            " VALUES (%s, 'acme', 'https://a.example.com/one', 'whsec_' || md5('one'))",
            (endpoint_id,),
        )
    return endpoint_id


def title(html: str) -> str:
    found = re.search(r"<title>([^<]*)</title>", html)
    assert found is not None
    return found.group(1)


async def test_an_error_page_says_it_once_under_the_signed_in_navigation(
    api: Api, browser: Browser, database_url: str
) -> None:
    """An error is said once, as an alert (not as a success's flash), with the reason in
    the title, the navigation of whoever is signed in, and a way back to where it came
    from; a request with no session gets no navigation at all."""
    endpoint_id = await one_endpoint(database_url)
    await browser.sign_in("acme_reader")
    status, html, _ = await browser.get("/deliveries?delivery_id=nope")
    assert status == 404
    assert html.count("no delivery") == 1 and 'class="flash"' not in html
    assert re.search(r'<p class="error" role="alert" id="error">no delivery', html)
    assert title(html) == "Error 404: Not found · fluxora-webhooks"
    assert '<nav aria-label="Main">' in html and "Sign out" in html
    assert '<a href="/deliveries" id="back">Back to the deliveries</a>' in html
    # A form refused (this token is read-only): back to the page the form was on.
    status, html, _ = await browser.post(
        f"/endpoints/{endpoint_id}/disable", {"next": "/endpoints"}
    )
    assert status == 403 and html.count("this token is read-only") == 1
    assert title(html) == "Error 403: Not allowed · fluxora-webhooks"
    assert '<a href="/endpoints" id="back">Back to the endpoints</a>' in html
    assert "Sign out" in html
    status, html, _ = await browser.post(f"/endpoints/{endpoint_id}/enable", {})
    assert (
        f'<a href="/endpoints/{endpoint_id}" id="back">Back to endpoint {endpoint_id}</a>' in html
    )
    # Signed out: an error page shows no navigation (and no session's token).
    async with api.session.get(api.url + "/endpoints/x/y/z", allow_redirects=False) as resp:
        assert resp.status == 404
        html = await resp.text()
    assert "<nav" not in html and "Sign out" not in html and 'name="csrf"' not in html
    assert html.count("no such resource") == 1


async def test_a_recover_time_that_is_not_valid_is_marked_at_its_field(
    browser: Browser, database_url: str
) -> None:
    """The endpoint's page again, its form as filled in, the field at fault marked
    invalid and described by the problem (said once), the error first in the title."""
    endpoint_id = await one_endpoint(database_url)
    await browser.sign_in("acme")
    path = f"/endpoints/{endpoint_id}/recover"
    status, html, _ = await browser.post(path, {"since": "yesterday-ish", "until": ""})
    assert status == 422
    assert title(html) == f"Error in since · Endpoint {endpoint_id} · fluxora-webhooks"
    assert html.count("neither an ISO 8601 time") == 1 and 'class="flash"' not in html
    assert re.search(r'<p class="error" id="recover-error">since: &#39;yesterday-ish&#39;', html)
    assert (
        '<input id="since" name="since" value="yesterday-ish" required aria-invalid="true"'
        ' aria-describedby="recover-error">'
    ) in html
    assert 'id="until" name="until" value="" placeholder="now">' in html
    status, html, _ = await browser.post(path, {"since": "2h", "until": "later"})
    assert status == 422
    assert 'value="2h" required>' in html
    assert 'value="later" placeholder="now" aria-invalid="true"' in html


async def test_a_failed_sign_in_marks_the_token_field(api: Api, browser: Browser) -> None:
    _, html, _ = await browser.get("/login")
    nonce = re.search(r'name="nonce" value="([^"]+)"', html)
    assert nonce is not None
    form = {"token": "not-a-token", "nonce": nonce.group(1)}
    async with browser.session.post(api.url + "/login", data=form) as resp:
        assert resp.status == 401
        html = await resp.text()
    assert '<p class="error" role="alert" id="token-error">' in html
    assert 'aria-invalid="true" aria-describedby="token-error"' in html


async def test_a_rotation_posted_without_its_confirmation_only_asks(
    browser: Browser, database_url: str
) -> None:
    """The dashboard's rotation takes a confirmation: a form without it (an old page, a
    keypress on the endpoint's page) changes nothing and asks, with the choice kept."""
    endpoint_id = await one_endpoint(database_url)

    async def secret() -> Any:
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            cur = await conn.execute(
                "SELECT secret FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
            )
            return (await cur.fetchone() or [None])[0]

    before = await secret()
    await browser.sign_in("acme")
    status, html, _ = await browser.post(f"/endpoints/{endpoint_id}/rotate", {"keep_previous": "0"})
    assert status == 200 and await secret() == before
    assert '<option value="0" selected>no time (it leaked)</option>' in html
    assert 'name="confirm" value="yes"' in html and 'id="leak-warning"' in html
    status, html, _ = await browser.get(f"/endpoints/{endpoint_id}/rotate?keep_previous=1h")
    assert status == 200 and await secret() == before
    assert '<option value="1h" selected>' in html
    status, html, _ = await browser.post(
        f"/endpoints/{endpoint_id}/rotate", {"keep_previous": "0", "confirm": "yes"}
    )
    assert status == 200 and await secret() != before
    assert 'id="kept">stopped signing now' in html


async def test_a_rotation_posted_again_rotates_once(browser: Browser, database_url: str) -> None:
    """A reload of the page that showed the new secret posts its confirmation again: the
    secret shown then keeps signing, and the first one stays the previous one for the
    time chosen (a second rotation would have dropped it at once)."""
    endpoint_id = await one_endpoint(database_url)

    async def secrets_now() -> tuple[Any, Any]:
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            cur = await conn.execute(
                "SELECT secret, secret_previous FROM webhook_endpoints WHERE id = %s",
                (endpoint_id,),
            )
            row = await cur.fetchone()
            assert row is not None
            return row[0], row[1]

    first, _ = await secrets_now()
    await browser.sign_in("acme")
    _, html, _ = await browser.get(f"/endpoints/{endpoint_id}/rotate")
    key = re.search(r'name="form_key" value="([A-Za-z0-9_-]{24})"', html)
    assert key is not None
    form = {"keep_previous": "24h", "confirm": "yes", "form_key": key.group(1)}
    status, html, _ = await browser.post(f"/endpoints/{endpoint_id}/rotate", form)
    assert status == 200 and "Secret rotated" in html
    rotated = await secrets_now()
    assert rotated[0] != first and rotated[1] == first
    status, html, _ = await browser.post(f"/endpoints/{endpoint_id}/rotate", form)
    assert status == 409 and 'id="rotated-before"' in html
    assert await secrets_now() == rotated
    # Another confirmation (the form opened again) rotates again.
    _, html, _ = await browser.get(f"/endpoints/{endpoint_id}/rotate")
    again = re.search(r'name="form_key" value="([A-Za-z0-9_-]{24})"', html)
    assert again is not None and again.group(1) != key.group(1)
    status, _, _ = await browser.post(
        f"/endpoints/{endpoint_id}/rotate", {**form, "form_key": again.group(1)}
    )
    assert status == 200 and (await secrets_now())[1] == rotated[0]


async def test_a_bidirectional_control_in_stored_text_is_shown_not_obeyed(
    api: Api, browser: Browser, database_url: str
) -> None:
    """A right-to-left override in a payload (or in a URL or description stored before
    they were refused) would show '/gpj.exe' as '/exe.jpg': every page shows its escape."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret, description)"
            " VALUES ('ep_rtl', 'acme', 'https://a.example.com/ok/\u202egpj.exe',"
            " 'whsec_' || md5('rtl'), 'old \u202edescription')"
        )
    body = {"stream_id": "s", "event_type": "t", "payload": {"file": "\u202egpj.exe"}}
    accepted = await api.post("/api/v1/events", token="acme", json=body)
    assert accepted.status == 202, accepted.text
    await browser.sign_in("acme")
    pages = ["/endpoints", "/endpoints/ep_rtl"]
    pages.append(f"/events/{accepted.body['id']}")
    for path in pages:
        status, html, _ = await browser.get(path)
        assert status == 200, path
        assert "\u202e" not in html, path
        assert "\\u202egpj.exe" in html, path
    # The edit form holds the values as stored: saved with another field changed, the URL
    # and the description stay as they were (their escapes were saved in their place, a
    # URL of another path).
    status, html, _ = await browser.get("/endpoints/ep_rtl/edit")
    assert 'value="https://a.example.com/ok/\u202egpj.exe"' in html
    form = {
        "url": "https://a.example.com/ok/\u202egpj.exe", "event_types": "*",
        "description": "old \u202edescription", "headers": "", "rate_limit": "5",
    }  # fmt: skip
    status, _, _ = await browser.post("/endpoints/ep_rtl/edit", form)
    assert status == 303
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute(
            "SELECT url, description, rate_limit FROM webhook_endpoints WHERE id = 'ep_rtl'"
        )
        assert await cur.fetchone() == (
            "https://a.example.com/ok/\u202egpj.exe",
            "old \u202edescription",
            5,
        )


async def test_an_event_too_deep_to_show_says_so(browser: Browser, database_url: str) -> None:
    """Nested 2,000 levels by a SQL producer: the page was a 500, then 'null'."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, tenant)"
            " VALUES ('s', 'deep', (repeat('[', 2000) || '1' || repeat(']', 2000))::jsonb,"
            " 'acme') RETURNING id"
        )
        row = await cur.fetchone()
        assert row is not None
    await browser.sign_in("acme")
    status, html, _ = await browser.get(f"/events/{row[0]}")
    assert status == 200
    assert '<p class="muted" id="payload-omitted">Not shown: nested deeper than 250' in html
