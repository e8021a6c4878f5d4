"""The tenant portal as a customer finds it, over HTTP against the real database: a session
that has ended says so and leads back to the page once signed in again (never off the
site), a delivery's page says why it ended or waits, and the dead letters of removed
endpoints are counted apart from those a replay or a recovery can still send."""

from __future__ import annotations

import dataclasses
import html as markup
import ipaddress
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import aiohttp
import psycopg
import pytest
import pytest_asyncio
from aiohttp import web

from fluxora_webhooks import deliveries, tokens
from fluxora_webhooks.delivery import EGRESS_HELD, RESOLVER_HELD
from fluxora_webhooks.metrics import DEAD_LETTER_REASONS
from fluxora_webhooks.secretbox import keyring_from_env, new_key
from tests.support.api import Api, serving
from tests.support.dispatch import make_settings, running_dispatcher, scalar, wait_until
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
ENDED = "Your session has ended (it expired, or its token was revoked). Sign in again to go on."
INTRO = "Sign in with the access token you were given."


@pytest_asyncio.fixture
async def api(database_url: str) -> AsyncIterator[Api]:
    async with serving(database_url) as running:
        yield running


class Portal:
    """A browser's dashboard session (cookies kept for 127.0.0.1, redirects not followed)."""

    def __init__(self, api: Api, session: aiohttp.ClientSession) -> None:
        self.api = api
        self.session = session

    async def sign_in(self, token: str, login_path: str = "/login", next_page: str = "") -> str:
        """Signs in with the form of ``login_path`` (its nonce, and ``next_page`` as its
        next when given, else the form's own); returns where the sign-in led."""
        status, html, _ = await self.get(login_path)
        assert status == 200, html
        nonce = re.search(r'name="nonce" value="([^"]+)"', html)
        assert nonce is not None
        form = {"token": self.api.tokens[token], "nonce": nonce.group(1)}
        if next_page:
            form["next"] = next_page
        elif (shown := hidden_next(html)) is not None:
            form["next"] = shown
        async with self.session.post(
            self.api.url + "/login", data=form, allow_redirects=False
        ) as resp:
            assert resp.status == 303, await resp.text()
            return str(resp.headers["location"])

    async def get(self, path: str) -> tuple[int, str, Any]:
        async with self.session.get(self.api.url + path, allow_redirects=False) as resp:
            return resp.status, await resp.text(), resp.headers

    async def csrf(self) -> str:
        _, html, _ = await self.get("/deliveries")
        found = re.search(r'name="csrf" value="([^"]+)"', html)
        assert found is not None, html
        return found.group(1)

    async def post(
        self, path: str, form: dict[str, str], headers: dict[str, str] | None = None
    ) -> tuple[int, str, Any]:
        async with self.session.post(
            self.api.url + path, data=form, headers=headers, allow_redirects=False
        ) as resp:
            return resp.status, await resp.text(), resp.headers


@pytest_asyncio.fixture
async def portal(api: Api) -> AsyncIterator[Portal]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield Portal(api, session)


def hidden_next(html: str) -> str | None:
    found = re.search(r'<input type="hidden" name="next" value="([^"]*)">', html)
    return None if found is None else found.group(1).replace("&amp;", "&")


def ended_login(page: str = "") -> str:
    return "/login?" + urlencode({"expired": "1", **({"next": page} if page else {})})


async def execute(database_url: str, sql: str, params: Any = None) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(sql, params)


async def add_endpoint(api: Api, url: str, tenant: str = "acme", events: str = "*") -> str:
    made = await api.post(
        "/api/v1/endpoints", json={"url": url, "tenant": tenant, "event_types": [events]}
    )
    assert made.status == 201, made.text
    return str(made.body["id"])


async def pending_delivery(database_url: str, endpoint_id: str, tenant: str = "acme") -> str:
    """A delivery of ``endpoint_id`` not attempted yet (as a routed event leaves it)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, endpoint_id)"
            " VALUES (%s, 's', 'thing.done', '{}', %s) RETURNING delivery_id::text",
            (tenant, endpoint_id),
        )
        row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def dead_letter(
    database_url: str,
    endpoint_id: str,
    reason: str,
    *,
    status_code: int | None = None,
    duration_ms: float | None = None,
    tenant: str = "acme",
) -> str:
    """A delivery that ended as a dead letter with ``reason`` (an attempt when it has a
    duration, as the dispatcher records one), its dead letter waiting."""
    delivery_id = await pending_delivery(database_url, endpoint_id, tenant)
    await execute(
        database_url,
        "UPDATE webhook_outbox SET processed = true, processed_at = now(),"
        " outcome = 'dead_letter', status_code = %s, duration_ms = %s, error = %s"
        " WHERE delivery_id = %s",
        (status_code, duration_ms, f"ended: {reason}", delivery_id),
    )
    await execute(
        database_url,
        "INSERT INTO webhook_dead_letter (delivery_id, stream_id, event_type, payload,"
        " attempts, reason, last_status, enqueued_at, tenant, endpoint_id)"
        " VALUES (%s, 's', 'thing.done', '{}', %s, %s, %s, now(), %s, %s)",
        (delivery_id, 0 if duration_ms is None else 1, reason, status_code, tenant, endpoint_id),
    )
    return delivery_id


def field(html: str, element_id: str) -> str:
    """The text of the element with this id (its markup dropped)."""
    found = re.search(rf'id="{element_id}"[^>]*>(.*?)</(?:dd|p)>', html, re.S)
    assert found is not None, f"no #{element_id} in the page"
    return markup.unescape(re.sub(r"<[^>]+>", "", found.group(1))).strip()


# -- a session that has ended -------------------------------------------------------------


async def test_an_expired_session_says_so_and_the_sign_in_goes_back_to_the_page(
    api: Api, portal: Portal, database_url: str
) -> None:
    """The page asked for with an expired session leads to the sign-in form, which says
    the session has ended (a status, not the failed token's alert), and the sign-in goes
    back to that page with its query; with no session cookie at all, the plain form."""
    page = "/deliveries?status=dead_letter&stream_id=a%20b"
    assert await portal.sign_in("acme") == "/"
    await execute(
        database_url, "UPDATE webhook_api_sessions SET expires_at = now() - interval '1s'"
    )
    status, _, headers = await portal.get(page)
    assert status == 303 and headers["location"] == ended_login(page)

    status, html, _ = await portal.get(headers["location"])
    assert status == 200 and html.count(ENDED) == 1
    assert f'<p class="flash" role="status" id="session-ended">{ENDED}</p>' in html
    assert "<title>Session ended · Sign in · fluxora-webhooks</title>" in html
    assert "aria-invalid" not in html and 'role="alert"' not in html
    assert hidden_next(html) == page
    assert await portal.sign_in("acme", headers["location"]) == page
    status, html, _ = await portal.get(page)
    assert status == 200 and 'value="a b"' in html

    # Never signed in: the plain form, as before, speaking to a customer too.
    async with aiohttp.ClientSession() as fresh:
        async with fresh.get(api.url + page, allow_redirects=False) as resp:
            assert resp.status == 303 and resp.headers["location"] == "/login"
        async with fresh.get(api.url + "/login") as resp:
            html = await resp.text()
    assert ENDED not in html and 'name="next"' not in html
    assert INTRO in html and "tokens create" not in html


async def test_a_form_posted_after_the_token_was_revoked_changes_nothing_and_leads_back(
    api: Api, portal: Portal, database_url: str
) -> None:
    """A post with a session whose token was revoked is not carried out; the sign-in leads
    to the page of what it acted on (its own next field is not read without a session),
    or to the page the Referer names when that is this site's."""
    endpoint_id = await add_endpoint(api, "https://a.example.com/hook")
    delivery_id = await pending_delivery(database_url, endpoint_id)
    await portal.sign_in("acme")
    csrf = await portal.csrf()
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await tokens.revoke(conn, "acme")

    form = {"csrf": csrf, "next": "/endpoints"}
    status, _, headers = await portal.post(f"/endpoints/{endpoint_id}/disable", form)
    assert status == 303 and headers["location"] == ended_login(f"/endpoints/{endpoint_id}")
    state = await scalar(
        database_url, "SELECT state FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
    )
    assert state == "enabled"
    status, _, headers = await portal.post(f"/deliveries/{delivery_id}/replay", form)
    assert headers["location"] == ended_login(f"/deliveries/{delivery_id}")
    # The Referer, when it is this site's page; another site's is never a way back.
    here = {"Referer": f"{api.url}/endpoints?cursor=abc"}
    status, _, headers = await portal.post(f"/endpoints/{endpoint_id}/enable", form, here)
    assert headers["location"] == ended_login("/endpoints?cursor=abc")
    elsewhere = {"Referer": "https://evil.example/endpoints?cursor=abc"}
    status, _, headers = await portal.post(f"/endpoints/{endpoint_id}/enable", form, elsewhere)
    assert headers["location"] == ended_login(f"/endpoints/{endpoint_id}")
    # A form's own page: that form again (with the endpoint it was opened for).
    status, _, headers = await portal.post(f"/endpoints/{endpoint_id}/edit", form)
    assert headers["location"] == ended_login(f"/endpoints/{endpoint_id}/edit")
    status, _, headers = await portal.post(f"/events/new?endpoint_id={endpoint_id}", form)
    assert headers["location"] == ended_login(f"/events/new?endpoint_id={endpoint_id}")
    # Signing out of a session that has ended: nothing to go back to.
    status, _, headers = await portal.post("/logout", {"csrf": csrf})
    assert status == 303 and headers["location"] == ended_login()

    status, html, _ = await portal.get(ended_login(f"/endpoints/{endpoint_id}"))
    assert ENDED in html
    assert await portal.sign_in("admin", ended_login(f"/endpoints/{endpoint_id}")) == (
        f"/endpoints/{endpoint_id}"
    )
    assert (await portal.get(f"/endpoints/{endpoint_id}"))[0] == 200
    assert (
        await scalar(
            database_url, "SELECT state FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
        )
        == "enabled"
    )


@pytest.mark.parametrize(
    "target",
    [
        "//evil.example",
        "https://evil.example",
        "/\\evil.example",
        "\\\\evil.example",
        "/\t/evil.example",
        "javascript:alert(1)",
        "evil.example",
        pytest.param("/" + "a" * 3000, id="too-long"),
    ],
)
async def test_the_sign_in_goes_to_next_only_when_it_is_a_page_of_this_site(
    portal: Portal, target: str
) -> None:
    """``next`` from the sign-in page's address or its form: a path of this site, or the
    overview; the page never carries another into its form."""
    status, html, _ = await portal.get(ended_login(target))
    assert status == 200 and ENDED in html
    assert hidden_next(html) is None
    assert await portal.sign_in("acme", next_page=target) == "/"
    # A page of this site is gone to (the sign-in page itself is not one to go back to).
    assert await portal.sign_in("acme", next_page="/endpoints?x=1") == "/endpoints?x=1"
    assert await portal.sign_in("acme", next_page="/login?expired=1") == "/"


async def test_the_session_cookie_outlives_its_session_to_say_it_has_ended(
    portal: Portal, database_url: str
) -> None:
    """A cookie gone with its session would leave only the bare form: it is kept longer
    than the session, which the server ends on time."""
    async with portal.session.get(portal.api.url + "/login") as resp:
        nonce = re.search(r'name="nonce" value="([^"]+)"', await resp.text())
    assert nonce is not None
    form = {"token": portal.api.tokens["acme"], "nonce": nonce.group(1)}
    async with portal.session.post(
        portal.api.url + "/login", data=form, allow_redirects=False
    ) as resp:
        cookie = resp.cookies["fx_session"]
    assert int(cookie["max-age"]) > tokens.SESSION_TTL_S
    left = await scalar(
        database_url, "SELECT EXTRACT(EPOCH FROM max(expires_at) - now()) FROM webhook_api_sessions"
    )
    assert tokens.SESSION_TTL_S - 60 < float(left) <= tokens.SESSION_TTL_S


# -- the sign-in form's value and origin (login CSRF) --------------------------------------

FORM_REFUSED = "This sign-in did not come from this dashboard's form"


async def login_post(
    api: Api, cookie: str, nonce: str, token: str = "", headers: dict[str, str] | None = None
) -> tuple[int, str, Any]:
    """``curl -b fx_login=<cookie> --data-urlencode nonce=<nonce> ...``: a client that sets
    the cookie it likes (another site's: a sibling subdomain, plain http). ``token``: the
    token's text (acme's when not given)."""
    form = {"token": token or api.tokens["acme"], "nonce": nonce}
    cookies = {"Cookie": f"fx_login={cookie}", **(headers or {})}
    async with (
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as client,
        client.post(api.url + "/login", data=form, headers=cookies, allow_redirects=False) as resp,
    ):
        return resp.status, await resp.text(), resp.headers


async def issued_value(api: Api) -> str:
    async with (
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as client,
        client.get(api.url + "/login") as resp,
    ):
        found = re.search(r'name="nonce" value="([^"]+)"', await resp.text())
        assert found is not None
        assert f"fx_login={found.group(1)};" in resp.headers["set-cookie"]
        return found.group(1)


async def sessions(database_url: str) -> int:
    return int(await scalar(database_url, "SELECT count(*) FROM webhook_api_sessions"))


async def test_a_login_value_the_server_did_not_issue_is_refused(
    api: Api, database_url: str
) -> None:
    """A cookie and a form value made up together (a login CSRF's pair) sign nobody in, nor
    does a value of the right shape under another key."""
    for made_up in ("a", "x" * 32 + ".1700000000." + "A" * 43):
        status, html, headers = await login_post(api, made_up, made_up)
        assert status == 403, html
        assert FORM_REFUSED in html and "fx_session" not in headers.get("set-cookie", "")
    # A real value, but not the cookie's: refused as well.
    status, _, _ = await login_post(api, "a", await issued_value(api))
    assert status == 403
    assert await sessions(database_url) == 0


async def test_a_sign_in_from_another_origin_is_refused(api: Api, database_url: str) -> None:
    value = await issued_value(api)
    for header in (
        {"Origin": "https://evil.example"},
        {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
        {"Origin": "https://evil.example", "Sec-Fetch-Site": "same-site"},
        {"Origin": api.url.replace("127.0.0.1", "localhost")},
        {"Origin": api.url.replace("http:", "https:")},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
    ):
        status, html, _ = await login_post(api, value, value, headers=header)
        assert status == 403 and FORM_REFUSED in html, header
    assert await sessions(database_url) == 0
    # A browser's own form (Chromium's headers under the pages' no-referrer policy), or a
    # post naming this origin: signed in; each value once.
    own = {"Origin": "null", "Sec-Fetch-Site": "same-origin"}
    status, html, headers = await login_post(api, value, value, headers=own)
    assert status == 303 and headers["location"] == "/", html
    value = await issued_value(api)
    status, html, _ = await login_post(api, value, value, headers={"Origin": api.url})
    assert status == 303, html
    # A browser on plain http to a host other than localhost sends no Sec-Fetch-*, and
    # Origin: null for the page's own form (no-referrer): the one-time value is the check.
    value = await issued_value(api)
    status, html, _ = await login_post(api, value, value, headers={"Origin": "null"})
    assert status == 303, html
    assert await sessions(database_url) == 3


async def test_a_login_value_signs_in_once(api: Api, database_url: str) -> None:
    value = await issued_value(api)
    # A wrong token does not use it up.
    status, _, _ = await login_post(api, value, value, token="fxa_wrong")
    assert status == 401
    status, _, _ = await login_post(api, value, value)
    assert status == 303
    status, html, _ = await login_post(api, value, value)
    assert status == 403 and FORM_REFUSED in html
    assert await sessions(database_url) == 1


async def test_an_expired_login_value_is_refused(api: Api, database_url: str) -> None:
    """A value signed with the database's key, issued just past the validity: refused; one
    just inside it: taken (so the refusal is its age)."""
    from fluxora_webhooks.api.dashboard import signin  # here: its test alone needs it

    key = bytes(await scalar(database_url, "SELECT key FROM webhook_api_login_key"))
    now = int(time.time())
    old = signin.make_value(key, now - signin.VALUE_TTL_S - 5)
    status, html, _ = await login_post(api, old, old)
    assert status == 403 and FORM_REFUSED in html
    assert await sessions(database_url) == 0
    recent = signin.make_value(key, now - signin.VALUE_TTL_S + 60)
    status, _, _ = await login_post(api, recent, recent)
    assert status == 303
    assert await sessions(database_url) == 1


# -- why a delivery ended or waits ---------------------------------------------------------


@dataclasses.dataclass
class Ended:
    refused: str  # delivery ids
    exhausted: str
    unrouted: int  # an event no endpoint subscribed to


@pytest_asyncio.fixture
async def ended(api: Api, database_url: str) -> AsyncIterator[Ended]:
    """Two deliveries sent by a real dispatcher: one refused with a 422, one failing with
    503 until its two attempts are spent."""
    refusing, failing = Receiver(), Receiver()
    refusing.respond = lambda r: web.Response(status=422, text="no thanks")
    failing.respond = lambda r: web.Response(status=503, text="busy")
    await refusing.start()
    await failing.start()
    try:
        await add_endpoint(api, refusing.url, events="refuse.*")
        await add_endpoint(api, failing.url, events="fail.*")
        made: dict[str, int] = {}
        for kind in ("refuse.it", "fail.it", "other.it"):
            body: dict[str, Any] = {"tenant": "acme", "stream_id": kind, "payload": {}}
            body["event_type"] = kind
            made[kind] = (await api.post("/api/v1/events", json=body)).body["id"]
        settings = make_settings(
            "", allowed_networks=LOOPBACK, secret=b"", max_attempts=2, retry_schedule_ms=(50,)
        )
        async with running_dispatcher(settings, database_url):

            async def settled() -> bool:
                left = await scalar(
                    database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed"
                )
                dead = await scalar(database_url, "SELECT count(*) FROM webhook_dead_letter")
                return int(left) == 0 and int(dead) == 2

            await wait_until(settled, timeout=30, what="both deliveries dead-lettered")
        ids = {}
        for kind in ("refuse.it", "fail.it"):
            event = (await api.get(f"/api/v1/events/{made[kind]}")).body
            (ids[kind],) = [d["delivery_id"] for d in event["deliveries"]]
        yield Ended(ids["refuse.it"], ids["fail.it"], made["other.it"])
    finally:
        await refusing.stop()
        await failing.stop()


async def test_an_event_page_says_an_event_went_nowhere_not_that_it_waits(
    api: Api, portal: Portal, ended: Ended
) -> None:
    """An event no endpoint subscribed to: unrouted, said as such (an empty deliveries
    list read as "not routed yet, or ..."), as the API's routing field has it."""
    assert (await api.get(f"/api/v1/events/{ended.unrouted}")).body["routing"] == "unrouted"
    await portal.sign_in("acme")
    status, html, _ = await portal.get(f"/events/{ended.unrouted}")
    assert status == 200, html
    assert "Deliveries (0)" in html
    assert "Unrouted: no endpoint of its tenant subscribed to its type" in html


async def test_a_dead_letters_page_says_why_it_ended_in_plain_words(
    api: Api, portal: Portal, database_url: str, ended: Ended
) -> None:
    await portal.sign_in("acme")
    status, html, _ = await portal.get(f"/deliveries/{ended.refused}")
    assert status == 200, html
    assert "<dt>why it ended</dt>" in html
    assert field(html, "why") == (
        "the receiver answered 422: a 4xx answer (but 408, 425 or 429) is not retried (http_4xx)"
    )
    status, html, _ = await portal.get(f"/deliveries/{ended.exhausted}")
    assert field(html, "why") == "every attempt failed (2 attempts) (attempts_exhausted)"
    assert "Attempts (2)" in html and 'id="no-attempts"' not in html
    # As the API names it.
    detail = await api.get(f"/api/v1/deliveries/{ended.exhausted}", token="acme")
    assert detail.body["dead_letter_reason"] == "attempts_exhausted"


async def test_a_removed_endpoints_dead_letter_says_it_was_never_sent(
    api: Api, portal: Portal, database_url: str
) -> None:
    """Its endpoint removed before its first attempt: the page says why it ended and that
    it was never attempted, not that it waits for its first attempt."""
    endpoint_id = await add_endpoint(api, "https://a.example.com/hook")
    delivery_id = await pending_delivery(database_url, endpoint_id)
    await portal.sign_in("acme")
    status, html, _ = await portal.get(f"/deliveries/{delivery_id}")
    assert field(html, "no-attempts") == "Not attempted yet."
    assert 'id="why"' not in html
    assert (await api.call("DELETE", f"/api/v1/endpoints/{endpoint_id}")).status == 204

    status, html, _ = await portal.get(f"/deliveries/{delivery_id}")
    assert status == 200 and 'id="status">dead_letter<' in html
    assert field(html, "why") == "its endpoint was removed before it was sent (endpoint_removed)"
    assert field(html, "no-attempts") == (
        "Never attempted: its endpoint was removed before it was sent."
    )
    assert "Not attempted yet" not in html


async def test_a_parked_delivery_says_it_waits_for_its_endpoint(
    api: Api, portal: Portal, database_url: str
) -> None:
    endpoint_id = await add_endpoint(api, "https://a.example.com/hook")
    delivery_id = await pending_delivery(database_url, endpoint_id)
    assert (await api.post(f"/api/v1/endpoints/{endpoint_id}/disable")).status == 200
    await portal.sign_in("acme")
    status, html, _ = await portal.get(f"/deliveries/{delivery_id}")
    assert status == 200 and 'id="status">parked<' in html
    assert "<dt>why it waits</dt>" in html
    waits = "its endpoint is disabled; it is sent when the endpoint is enabled"
    assert field(html, "why") == waits
    assert field(html, "no-attempts") == f"Not attempted yet: {waits}."


async def test_deliveries_an_egress_outage_holds_are_counted_in_the_stats_and_overview(
    api: Api, portal: Portal, database_url: str
) -> None:
    """A delivery held by an egress proxy's outage keeps EGRESS_HELD as its row's error
    until it is sent (the dispatcher's part: test_egress_proxy). The stats count them per
    scope, held for later or due again and not claimed yet; neither a retry waiting for
    another reason nor a parked delivery is counted; the overview says how many and why."""
    acme = await add_endpoint(api, "https://a.example.com/hook")
    bolt = await add_endpoint(api, "https://b.example.com/hook", tenant="bolt")
    held = [await pending_delivery(database_url, acme) for _ in range(3)]
    held.append(await pending_delivery(database_url, bolt, tenant="bolt"))
    dues = ("1 minute", "1 hour", "-1 second", "1 minute")
    whys = (EGRESS_HELD, RESOLVER_HELD, EGRESS_HELD, RESOLVER_HELD)  # the proxy, DNS
    for delivery_id, due, held_why in zip(held, dues, whys, strict=True):
        await execute(
            database_url,
            "UPDATE webhook_outbox SET created_at = now() + %s::interval, error = %s"
            " WHERE delivery_id = %s",
            (due, held_why, delivery_id),
        )
    retry = await pending_delivery(database_url, acme)
    await execute(
        database_url,
        "UPDATE webhook_outbox SET created_at = now() + interval '1 minute',"
        " error = 'HTTP 503' WHERE delivery_id = %s",
        (retry,),
    )
    parked = await add_endpoint(api, "https://a.example.com/parked")
    await pending_delivery(database_url, parked)
    assert (await api.post(f"/api/v1/endpoints/{parked}/disable")).status == 200

    for token, count in {"admin": 4, "acme": 3, "bolt": 1, "default": 0}.items():
        stats = await api.get("/api/v1/stats", token=token)
        assert stats.status == 200 and stats.body["backlog"]["egress_held"] == count, token
    reply = await api.get("/api/v1/stats", params={"tenant": "bolt"})
    assert reply.body["backlog"]["egress_held"] == 1

    why = (
        "this service's way out failed (its egress proxy or its DNS lookups), so no consumer"
        " was asked and no attempt is used"
    )
    await portal.sign_in("acme")
    _, html, _ = await portal.get("/")
    said = f"3 deliveries are held: {why}; they are sent when it works again."
    assert field(html, "egress-held") == said
    assert 'href="/deliveries?held=1">3 deliveries are held</a>' in html
    # The link lists them: the held ones only, the tenant's own.
    _, html, _ = await portal.get("/deliveries?held=1")
    assert 'id="held-only"' in html and all(d in html for d in held[:3]), html
    assert retry not in html and held[3] not in html
    # The API's search too, per scope.
    for token, wanted in {"acme": held[:3], "bolt": held[3:], "admin": held}.items():
        reply = await api.get("/api/v1/deliveries", params={"held": "true"}, token=token)
        assert reply.status == 200, reply.body
        found = {d["delivery_id"] for d in reply.body["data"]}
        assert found == set(wanted), token
    reply = await api.get("/api/v1/deliveries", params={"held": "maybe"})
    assert reply.status == 422 and "held" in str(reply.body), reply.body
    await portal.sign_in("bolt")
    _, html, _ = await portal.get("/")
    said = f"1 delivery is held: {why}; it is sent when it works again."
    assert field(html, "egress-held") == said
    await portal.sign_in("default")
    _, html, _ = await portal.get("/")
    assert 'id="egress-held"' not in html

    # Sent, they are held no longer (the dispatcher marks the row processed).
    await execute(
        database_url,
        "UPDATE webhook_outbox SET processed = true, processed_at = now(),"
        " outcome = 'delivered', error = NULL WHERE delivery_id = ANY(%s::uuid[])",
        (held,),
    )
    await portal.sign_in("admin")
    _, html, _ = await portal.get("/")
    assert 'id="egress-held"' not in html
    assert (await api.get("/api/v1/stats")).body["backlog"]["egress_held"] == 0


async def test_the_held_search_finds_held_retries_too_and_only_with_a_status_they_can_have(
    api: Api, database_url: str
) -> None:
    """A held delivery is pending (its first attempt held) or retrying (a later one held):
    `held=true` finds both, found from the held rows themselves (not by reading every
    delivery of the scope), and with a status a held delivery cannot have, none."""
    acme = await add_endpoint(api, "https://a.example.com/hook")
    first, later, plain = [await pending_delivery(database_url, acme) for _ in range(3)]
    await execute(
        database_url, "UPDATE webhook_outbox SET error = %s WHERE delivery_id = %s",
        (RESOLVER_HELD, first),
    )  # fmt: skip
    # Its first attempt failed (processed, a retry), its second held by the egress proxy.
    await execute(
        database_url,
        "WITH done AS (UPDATE webhook_outbox SET processed = true, processed_at = now(),"
        " outcome = 'retry', status_code = 503, error = 'HTTP 503', duration_ms = 5"
        " WHERE delivery_id = %s RETURNING *)"
        " INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, delivery_id,"
        " endpoint_id, event_id, enqueued_at, attempt, error, created_at)"
        " SELECT tenant, stream_id, event_type, payload, delivery_id, endpoint_id,"
        " COALESCE(event_id, id), enqueued_at, 2, %s, now() + interval '1 minute' FROM done",
        (later, EGRESS_HELD),
    )
    wanted = {"": {first, later}, "pending": {first}, "retrying": {later}}
    for status in ("", "pending", "retrying", "delivered", "dead_letter", "parked"):
        params = {"held": "true", **({"status": status} if status else {})}
        reply = await api.get("/api/v1/deliveries", params=params, token="acme")
        assert reply.status == 200, reply.body
        found = {d["delivery_id"] for d in reply.body["data"]}
        assert found == wanted.get(status, set()), status
    everything = await api.get("/api/v1/deliveries", token="acme")
    assert {d["delivery_id"] for d in everything.body["data"]} == {first, later, plain}


async def test_a_tenants_search_naming_another_tenant_is_refused_not_answered_as_its_own(
    api: Api, portal: Portal, database_url: str
) -> None:
    """As the API answers a tenant token naming another tenant 403 (tenant_forbidden), the
    portal says so, where it showed the tenant's own deliveries under the other's name."""
    acme = await add_endpoint(api, "https://a.example.com/hook")
    mine = await pending_delivery(database_url, acme)
    refused = (
        "this sign-in acts for its own tenant only: another tenant's deliveries cannot be"
        " searched from it"
    )
    await portal.sign_in("acme")
    for query in ("tenant=bolt", "default_tenant=1", "tenant=bolt&status=pending"):
        status, html, _ = await portal.get(f"/deliveries?{query}")
        assert status == 403 and field(html, "error") == refused, query
        assert mine not in html
    for query in ("tenant=acme", "tenant=", "status=pending"):
        status, html, _ = await portal.get(f"/deliveries?{query}")
        assert status == 200 and mine in html, query
    await portal.sign_in("default")  # the default tenant's own: its filter is its own
    status, html, _ = await portal.get("/deliveries?default_tenant=1")
    assert status == 200 and mine not in html
    await portal.sign_in("admin")
    status, html, _ = await portal.get("/deliveries?tenant=acme")
    assert status == 200 and mine in html
    status, html, _ = await portal.get("/deliveries?tenant=bolt")
    assert status == 200 and mine not in html


async def test_a_search_the_list_cannot_answer_is_refused_not_answered_with_everything(
    api: Api, portal: Portal, database_url: str
) -> None:
    """A misspelt filter, a status that is none, or a tenant with 'default tenant only'
    listed every delivery (the status menu saying 'any'): each is a 400 that says why, as
    the API's 422 does; the form's own submission, empty fields and all, still lists."""
    acme = await add_endpoint(api, "https://a.example.com/hook")
    mine = await pending_delivery(database_url, acme)
    await portal.sign_in("admin")
    refusals = {
        "endpoint=x": "unknown filter 'endpoint' (this list takes: cursor, default_tenant,",
        "status=bogus": "status 'bogus' is not one of pending, retrying, parked, delivered,",
        "tenant=acme&default_tenant=1": "give a tenant or tick 'default tenant only', not both",
    }
    for query, said in refusals.items():
        status, html, _ = await portal.get(f"/deliveries?{query}")
        assert status == 400 and said in field(html, "error"), query
        assert mine not in html, query
    form = "stream_id=&event_type=&delivery_id=&endpoint_id=&tenant=acme&status="
    status, html, _ = await portal.get(f"/deliveries?{form}")
    assert status == 200 and mine in html


async def test_every_dead_letter_reason_has_words_of_its_own(
    api: Api, portal: Portal, database_url: str
) -> None:
    """Each reason a dead letter can have (metrics.DEAD_LETTER_REASONS) is said in words,
    the reason's name beside them; one with no request made says it was never attempted,
    one with an attempt shows it."""
    endpoint_id = await add_endpoint(api, "https://a.example.com/hook")
    await portal.sign_in("acme")
    said = {}
    answers = {"http_4xx": 400, "http_3xx": 302, "attempts_exhausted": 503}
    for reason in DEAD_LETTER_REASONS:
        unsent = reason in ("endpoint_removed", "invalid_request", "internal_error")
        delivery_id = await dead_letter(
            database_url,
            endpoint_id,
            reason,
            status_code=answers.get(reason),
            duration_ms=None if unsent else 12.5,
        )
        status, html, _ = await portal.get(f"/deliveries/{delivery_id}")
        assert status == 200, html
        words = field(html, "why")
        assert words.endswith(f" ({reason})") and words != f"{reason} ({reason})", words
        said[reason] = words.removesuffix(f" ({reason})")
        if unsent:
            assert field(html, "no-attempts") == f"Never attempted: {said[reason]}."
        else:
            assert 'id="no-attempts"' not in html and "Attempts (1)" in html
    assert len(set(said.values())) == len(said), said
    assert said["http_3xx"].startswith("the receiver answered 302")
    assert said["attempts_exhausted"] == "every attempt failed (1 attempt)"


# -- dead letters of removed endpoints ---------------------------------------------------


async def test_dead_letters_of_removed_endpoints_are_counted_apart(
    api: Api, portal: Portal, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``waiting``: the dead letters a replay or a recovery can send; those whose endpoint
    was removed (reason endpoint_removed, or dead before the removal) are counted apart,
    for the API and the overview alike, within the same cap."""
    kept = await add_endpoint(api, "https://a.example.com/kept")
    gone = await add_endpoint(api, "https://a.example.com/gone")
    gone_later = await add_endpoint(api, "https://a.example.com/later")
    for _ in range(2):
        await dead_letter(database_url, kept, "http_4xx", status_code=400, duration_ms=3.0)
    old = await dead_letter(database_url, gone_later, "http_4xx", status_code=400, duration_ms=3)
    for _ in range(3):
        await pending_delivery(database_url, gone)
    for endpoint_id in (gone, gone_later):
        assert (await api.call("DELETE", f"/api/v1/endpoints/{endpoint_id}")).status == 204
    # The built-in default endpoint's, not configured here: it waits for it, as `dlq` has it.
    await dead_letter(database_url, "default", "attempts_exhausted", tenant="")

    # Nothing can send them: why they are apart.
    assert (await api.post(f"/api/v1/deliveries/{old}/replay")).status == 409
    recover = await api.post(f"/api/v1/endpoints/{gone}/recover", json={"since": "1h"})
    assert recover.status == 404

    expected = {
        "admin": {"waiting": 3, "of_removed_endpoints": 4},
        "acme": {"waiting": 2, "of_removed_endpoints": 4},
        "bolt": {"waiting": 0, "of_removed_endpoints": 0},
    }
    for token, counts in expected.items():
        stats = await api.get("/api/v1/stats", token=token)
        assert stats.status == 200 and stats.body["dead_letters"] == counts, token
    stats = await api.get("/api/v1/stats", params={"tenant": "acme"})
    assert stats.body["dead_letters"] == expected["acme"]

    await portal.sign_in("acme")
    _, html, _ = await portal.get("/")
    assert '<p class="big" id="dead-letters">2</p>' in html
    assert field(html, "dead-letters-note") == (
        "waiting to be replayed or recovered · 4 of removed endpoints"
        " (kept for the record until an operator purges them)"
    )
    await portal.sign_in("admin")
    _, html, _ = await portal.get("/")
    assert '<p class="big" id="dead-letters">3</p>' in html
    assert field(html, "dead-letters-note").endswith(
        "· 4 of removed endpoints (kept for the record until dlq purge discards them)"
    )
    await portal.sign_in("bolt")
    _, html, _ = await portal.get("/")
    assert field(html, "dead-letters-note") == "waiting to be replayed or recovered"

    # The two counts share the cap; purged, a dead letter is in neither.
    monkeypatch.setattr(deliveries, "STATS_COUNT_CAP", 5)
    stats = await api.get("/api/v1/stats", token="acme")
    assert sum(stats.body["dead_letters"].values()) == 5
    assert stats.body["backlog"]["capped_at"] == 5
    await execute(
        database_url,
        "UPDATE webhook_dead_letter SET state = 'purged' WHERE endpoint_id = %s",
        (gone,),
    )
    stats = await api.get("/api/v1/stats", token="acme")
    assert stats.body["dead_letters"] == {"waiting": 2, "of_removed_endpoints": 1}


# -- a custom header's credential ---------------------------------------------------------


async def test_a_custom_headers_credential_is_never_on_a_page_and_the_form_keeps_it(
    api: Api, portal: Portal, database_url: str
) -> None:
    """The endpoint's page and its change form show a credential header as ********; the
    form posted with it as shown keeps the stored value while another header changes."""
    made = await api.post(
        "/api/v1/endpoints",
        json={
            "url": "https://a.example.com/hook",
            "tenant": "acme",
            "headers": {"Authorization": "Bearer page-s3cr3t-value", "X-Team": "billing"},
        },
    )
    assert made.status == 201, made.text
    endpoint_id = made.body["id"]
    await portal.sign_in("acme")
    for page in (f"/endpoints/{endpoint_id}", f"/endpoints/{endpoint_id}/edit", "/endpoints"):
        status, html, _ = await portal.get(page)
        assert status == 200 and "page-s3cr3t-value" not in html, page
    _, html, _ = await portal.get(f"/endpoints/{endpoint_id}")
    assert "Authorization: ********" in markup.unescape(html)
    _, html, _ = await portal.get(f"/endpoints/{endpoint_id}/edit")
    shown = re.search(r'<textarea[^>]*name="headers"[^>]*>(.*?)</textarea>', html, re.S)
    assert shown is not None
    assert sorted(markup.unescape(shown.group(1)).splitlines()) == [
        "Authorization: ********",
        "X-Team: billing",
    ]

    form = {
        "csrf": await portal.csrf(),
        "url": "https://a.example.com/hook",
        "event_types": "*",
        "description": "",
        "headers": "Authorization: ********\nX-Team: ops",
        "rate_limit": "",
    }
    status, html, _ = await portal.post(f"/endpoints/{endpoint_id}/edit", form)
    assert status == 303, html
    stored = await scalar(
        database_url, "SELECT headers FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
    )
    assert stored == {"Authorization": "Bearer page-s3cr3t-value", "X-Team": "ops"}


# -- what keeps an endpoint from being sent to ----------------------------------------------


async def endpoint_with_certificate(api: Api, issued: Any) -> dict[str, Any]:
    """An endpoint of acme's that presents ``issued`` (a trustme certificate), as the API
    answered its creation."""
    made = await api.post(
        "/api/v1/endpoints",
        json={
            "url": "https://a.example.com/hook",
            "tenant": "acme",
            "client_certificate": {
                "certificate": issued.cert_chain_pems[0].bytes().decode(),
                "private_key": issued.private_key_pem.bytes().decode(),
            },
        },
    )
    assert made.status == 201, made.text
    return dict(made.body)


async def test_a_certificate_that_expired_while_set_is_shown_expired(
    api: Api, portal: Portal, database_url: str
) -> None:
    """An endpoint's client certificate past its expiry (it expired while set: the API
    refuses an expired one) is said to have expired, not to be 'valid until' a past day."""
    import trustme

    client_ca = trustme.CA()
    made = await endpoint_with_certificate(api, client_ca.issue_cert("bank-customer.example"))
    endpoint_id = made["id"]
    await portal.sign_in("acme")
    _, html, _ = await portal.get(f"/endpoints/{endpoint_id}")
    assert "valid until 3000-01-01" in field(html, "client-certificate")
    assert 'id="certificate-expired"' not in html
    now = datetime.now(UTC)
    lapsed = client_ca.issue_cert(
        "bank-customer.example",
        not_before=now - timedelta(days=30),
        not_after=now - timedelta(days=1),
    )
    await execute(
        database_url,
        "UPDATE webhook_endpoints SET client_cert = %s WHERE id = %s",
        (lapsed.cert_chain_pems[0].bytes().decode(), endpoint_id),
    )
    _, html, _ = await portal.get(f"/endpoints/{endpoint_id}")
    shown = field(html, "client-certificate")
    assert f"expired on {(now - timedelta(days=1)):%Y-%m-%d}" in shown, shown
    assert "valid until" not in shown and 'id="certificate-expired"' in html


async def test_a_certificate_given_before_its_validity_is_taken_and_shown_not_valid_yet(
    api: Api, portal: Portal
) -> None:
    """A renewed client certificate set ahead of its start of validity is taken (it will
    do from then on); the API gives its not_before, and the endpoint's page says it is not
    valid yet, not that it is 'valid until' its end."""
    import trustme

    starts = datetime.now(UTC) + timedelta(days=10)
    early = trustme.CA().issue_cert(
        "bank-customer.example", not_before=starts, not_after=starts + timedelta(days=365)
    )
    made = await endpoint_with_certificate(api, early)
    given = made["client_certificate"]
    assert datetime.fromisoformat(given["not_before"]) == starts.replace(microsecond=0)
    await portal.sign_in("acme")
    _, html, _ = await portal.get(f"/endpoints/{made['id']}")
    shown = field(html, "client-certificate")
    assert f"not valid before {starts:%Y-%m-%d}" in shown, shown
    assert "a consumer that checks it refuses it until then" in shown
    assert 'id="certificate-not-yet-valid"' in html and 'id="certificate-expired"' not in html


async def test_a_locked_endpoint_says_which_value_no_key_opens_and_how_to_free_it(
    api: Api, portal: Portal, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endpoint whose secret and credential header are sealed with a key this server
    does not have: its page says it cannot be sent to, naming each value (and to an admin
    the key id), with the way out (a rotation with no time for the old secret, the header
    typed again); the list marks it. Once given new values, nothing is said."""
    lost, here = new_key(), new_key()
    monkeypatch.setenv("WEBHOOK_ENCRYPTION_KEY", lost)
    locked = await api.post(
        "/api/v1/endpoints",
        json={
            "url": "https://a.example.com/hook",
            "tenant": "acme",
            "headers": {"Authorization": "Bearer locked-s3cr3t-value"},
        },
    )
    assert locked.status == 201, locked.text
    locked_id = locked.body["id"]
    monkeypatch.setenv("WEBHOOK_ENCRYPTION_KEY", here)  # the lost key is gone
    fine_id = await add_endpoint(api, "https://b.example.com/hook")
    lost_id = keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": lost}).current
    assert lost_id is not None

    await portal.sign_in("acme")
    _, html, _ = await portal.get(f"/endpoints/{locked_id}")
    notice = markup.unescape(re.sub(r"<[^>]+>", "", html.split('id="locked"', 1)[1]))
    notice = notice.split("</section>", 1)[0]
    assert "It cannot be sent to" in notice and "its secret" in notice
    assert "the value of its header Authorization" in notice
    assert "WEBHOOK_ENCRYPTION_KEY" not in notice  # a tenant is not told the operator's settings
    assert f'href="/endpoints/{locked_id}/rotate?keep_previous=0"' in html
    assert f'href="/endpoints/{locked_id}/edit"' in html and "locked-s3cr3t-value" not in html
    _, html, _ = await portal.get("/endpoints")
    assert f'href="/endpoints/{locked_id}#locked"' in html
    assert f'href="/endpoints/{fine_id}#locked"' not in html
    _, html, _ = await portal.get(f"/endpoints/{fine_id}")
    assert 'id="locked"' not in html

    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        admin = Portal(api, session)
        await admin.sign_in("admin")
        _, html, _ = await admin.get(f"/endpoints/{locked_id}")
        assert f"encrypted with key {lost_id.id}" in html and "WEBHOOK_ENCRYPTION_KEY" in html

    # Freed: a new secret (the old one kept signing no time) and the header typed again.
    rotated = await api.post(
        f"/api/v1/endpoints/{locked_id}/rotate-secret", json={"keep_previous": "0"}
    )
    assert rotated.status == 200, rotated.text
    _, html, _ = await portal.get(f"/endpoints/{locked_id}")
    assert "its secret" not in html.split('id="locked"', 1)[1].split("</section>", 1)[0]
    changed = await api.call(
        "PATCH",
        f"/api/v1/endpoints/{locked_id}",
        json={"headers": {"Authorization": "Bearer new-value"}},
    )
    assert changed.status == 200, changed.text
    _, html, _ = await portal.get(f"/endpoints/{locked_id}")
    assert 'id="locked"' not in html
    _, html, _ = await portal.get("/endpoints")
    assert f'href="/endpoints/{locked_id}#locked"' not in html
