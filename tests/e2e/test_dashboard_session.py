"""A dashboard session that ends while a page is open, in a real browser (Debian's Chromium
driven by Playwright): the next click says the session has ended rather than showing a
bare sign-in form, and signing in again leads back to the page, whether the session
expired (its cookie is still sent: it outlives the session) or its token was revoked."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import psycopg
import pytest
import pytest_asyncio
from playwright.async_api import Browser, expect

from fluxora_webhooks import tokens
from tests.e2e.test_dashboard_browser import SHOTS
from tests.support.api import Api, serving
from tests.support.browser import chromium
from tests.support.dispatch import scalar

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

ENDED = "Your session has ended (it expired, or its token was revoked). Sign in again to go on."


@pytest_asyncio.fixture(loop_scope="module")
async def api(database_url: str) -> AsyncIterator[Api]:
    async with serving(database_url) as running:
        yield running


async def test_an_ended_session_is_said_and_the_sign_in_leads_back(
    browser: Browser, api: Api, database_url: str
) -> None:
    made = await api.post(
        "/api/v1/endpoints", json={"url": "https://a.example.com/hook", "tenant": "acme"}
    )
    endpoint_id = made.body["id"]
    context = await browser.new_context(viewport={"width": 1200, "height": 900})
    page = await context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        await page.goto(api.url + "/login")
        await page.fill("#token", api.tokens["acme"])
        posting = page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/login"))
        async with posting as posted:
            await page.click("#login button[type=submit]")
        await page.wait_for_url(api.url + "/")
        # The browser's own sign-in: Origin null (the page's Referrer-Policy: no-referrer),
        # taken because the browser says same-origin; another origin or site is refused.
        sent = await (await posted.value).all_headers()
        assert sent["origin"] == "null" and sent["sec-fetch-site"] == "same-origin"
        # The cookie is kept past its session's end: the server ends the session on time,
        # and the browser still names it then, to be told so.
        cookie = {c["name"]: c for c in await context.cookies()}["fx_session"]
        ends = await scalar(
            database_url, "SELECT EXTRACT(EPOCH FROM max(expires_at)) FROM webhook_api_sessions"
        )
        assert cookie["expires"] > float(ends) + 86_400

        # A page left open past the session's end: its button leads to the sign-in form,
        # which says why; the token field keeps the focus and is not marked invalid.
        await page.goto(f"{api.url}/endpoints/{endpoint_id}")
        await scalar(
            database_url,
            "UPDATE webhook_api_sessions SET expires_at = now() - interval '1s' RETURNING 1",
        )
        await page.locator("button[data-action=disable]").click()
        await page.wait_for_url(re.compile(r"/login\?expired=1&next="))
        await expect(page.get_by_role("status")).to_have_text(ENDED)
        assert await page.title() == "Session ended · Sign in · fluxora-webhooks"
        token = page.get_by_label("Token")
        await expect(token).to_be_focused()
        await expect(token).not_to_have_attribute("aria-invalid", "true")
        SHOTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(SHOTS / "session-ended.png"), full_page=True)
        await token.fill(api.tokens["acme"])
        await page.keyboard.press("Enter")
        await page.wait_for_url(f"{api.url}/endpoints/{endpoint_id}")
        # Back on the page; the post that found the session ended was not carried out.
        await expect(page.locator("h1 .state")).to_have_text("enabled")

        # The token revoked: a page asked for leads back to itself, its query kept.
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await tokens.revoke(c, "acme")
        wanted = "/deliveries?status=parked&stream_id=s-1"
        await page.goto(api.url + wanted)
        await expect(page.get_by_role("status")).to_have_text(ENDED)
        await page.fill("#token", api.tokens["acme_reader"])
        await page.click("#login button[type=submit]")
        await page.wait_for_url(api.url + wanted)
        await expect(page.locator("input[name=stream_id]")).to_have_value("s-1")
        assert errors == []
    finally:
        await context.close()


async def test_a_browser_on_plain_http_to_a_named_host_signs_in(api: Api) -> None:
    """A dashboard reached over plain http at a name other than localhost (a private
    address, as the docs allow): the browser sends no Sec-Fetch-* there (not a secure
    context) and Origin: null for the page's own form. It signs in; the server-issued,
    one-time value is the check. The name is mapped to loopback inside the browser."""
    port = api.url.rsplit(":", 1)[1]
    named = f"http://dashboard.test:{port}"
    async with chromium("--host-resolver-rules=MAP dashboard.test 127.0.0.1") as browser:
        page = await browser.new_page()
        await page.goto(named + "/login")
        await page.fill("#token", api.tokens["acme"])
        posting = page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/login"))
        async with posting as posted:
            await page.click("#login button[type=submit]")
        await page.wait_for_url(named + "/")
        sent = await (await posted.value).all_headers()
        assert sent.get("origin") == "null" and "sec-fetch-site" not in sent, sent
