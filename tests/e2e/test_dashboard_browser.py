"""The dashboard in a real browser (Debian's Chromium driven by Playwright): sign in with
a token, every page, replay, disable and enable, rotate (the secret shown once), recover;
stored markup (a payload with <script> and onerror=, a response body with markup) is shown
as text and never runs; a tenant's token sees its own portal only; a read-only token and
a forged form change nothing. A screenshot of each page goes to test-artifacts/."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from aiohttp import web
from playwright.async_api import Browser, Dialog, Page, async_playwright

from tests.support.api import LOOPBACK, Api, serving
from tests.support.dispatch import make_settings, running_dispatcher, scalar, wait_until
from tests.support.receiver import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

CHROMIUM = Path("/usr/bin/chromium")
HAVE_CHROMIUM = CHROMIUM.exists()
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
XSS_PAYLOAD = {
    "note": "<script>window.__pwned = 'script'; alert('script')</script>",
    "img": "<img src=x onerror=\"window.__pwned = 'onerror'; alert('onerror')\">",
}
XSS_RESPONSE = "<img src=x onerror=\"window.__pwned='response'\"><b>bold?</b>"
BULK = 55  # more than one page of the dashboard's list (50)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    if not HAVE_CHROMIUM:
        pytest.fail("Debian's chromium is not installed (apt-get install chromium)")
    async with async_playwright() as pw:
        launched = await pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield launched
        finally:
            await launched.close()


@dataclasses.dataclass
class Site:
    api: Api
    acme: str  # endpoint ids
    acme_failing: str
    bolt: str
    xss_delivery: str
    dead_delivery: str
    bolt_delivery: str


async def _receiver(respond: Any) -> Receiver:
    recv = Receiver()
    recv.respond = respond
    await recv.start()
    return recv


@pytest_asyncio.fixture(loop_scope="module")
async def site(database_url: str) -> AsyncIterator[Site]:
    ok = await _receiver(lambda r: web.Response(status=200, text=XSS_RESPONSE))
    refusing = await _receiver(lambda r: web.Response(status=422, text="no thanks"))
    try:
        async with serving(database_url) as api:

            async def add(url: str, tenant: str, events: str = "*") -> str:
                body = {"url": url, "tenant": tenant, "event_types": [events]}
                reply = await api.post("/api/v1/endpoints", json=body)
                return str(reply.body["id"])

            # The refusing one receives the markup event only: one dead letter to recover.
            acme, acme_failing = await add(ok.url, "acme"), await add(refusing.url, "acme", "x.*")
            bolt = await add(ok.url, "bolt")
            xss = await api.post(
                "/api/v1/events",
                json={
                    "tenant": "acme",
                    "stream_id": "xss",
                    "event_type": "x.y",
                    "payload": XSS_PAYLOAD,
                },
            )
            async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
                await c.execute(
                    "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                    " SELECT 'acme', 'bulk-' || g, 'bulk.made', jsonb_build_object('g', g)"
                    " FROM generate_series(1, %s) g",
                    (BULK,),
                )
                await c.execute(
                    "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                    " VALUES ('bolt', 'bolt-secret-stream', 'bolt.only', '{\"b\": 1}')"
                )
            settings = make_settings("", allowed_networks=LOOPBACK, secret=b"")
            async with running_dispatcher(settings, database_url):

                async def settled() -> bool:
                    left = await scalar(
                        database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed"
                    )
                    return int(left) == 0

                await wait_until(settled, timeout=30, what="every delivery finished")
            event = (await api.get(f"/api/v1/events/{xss.body['id']}")).body
            by_endpoint = {d["endpoint_id"]: d["delivery_id"] for d in event["deliveries"]}
            bolt_list = await api.get("/api/v1/deliveries", params={"tenant": "bolt"})
            yield Site(
                api,
                acme,
                acme_failing,
                bolt,
                by_endpoint[acme],
                by_endpoint[acme_failing],
                bolt_list.body["data"][0]["delivery_id"],
            )
    finally:
        await ok.stop()
        await refusing.stop()


@dataclasses.dataclass
class Tab:
    page: Page
    dialogs: list[str]
    base: str
    console_errors: list[str]  # what the browser's console reported as errors (CSP too)

    async def open(self, path: str) -> None:
        response = await self.page.goto(self.base + path)
        assert response is not None

    async def shot(self, name: str) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        await self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)

    async def pwned(self) -> Any:
        return await self.page.evaluate("() => window.__pwned")


async def signed_in(browser: Browser, site: Site, token: str) -> AsyncIterator[Tab]:
    context = await browser.new_context(viewport={"width": 1360, "height": 900})
    page = await context.new_page()
    dialogs: list[str] = []

    async def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        await dialog.dismiss()

    page.on("dialog", on_dialog)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab = Tab(page, dialogs, site.api.url, errors)
    await tab.open("/")
    assert page.url.endswith("/login")  # no session: the sign-in form
    await page.fill("#token", site.api.tokens[token])
    await page.click("#login button[type=submit]")
    await page.wait_for_url(site.api.url + "/")
    try:
        yield tab
    finally:
        await context.close()


@pytest_asyncio.fixture(loop_scope="module")
async def admin(browser: Browser, site: Site) -> AsyncIterator[Tab]:
    async for tab in signed_in(browser, site, "admin"):
        yield tab


async def test_sign_in_and_every_page_with_stored_markup_shown_as_text(
    admin: Tab, site: Site
) -> None:
    page = admin.page
    cookies = {c["name"]: c for c in await page.context.cookies()}
    assert cookies["fx_session"]["httpOnly"] and cookies["fx_session"]["sameSite"] == "Strict"
    assert site.api.tokens["admin"] not in json.dumps(list(cookies.values()))
    assert await page.locator("#backlog").inner_text() == "0"
    assert await page.locator("svg.plot").count() == 4
    await admin.shot("overview")

    await page.click("header nav >> text=Endpoints")
    await page.wait_for_url("**/endpoints")
    for endpoint_id in (site.acme, site.acme_failing, site.bolt):
        assert await page.locator(f"tr[data-endpoint='{endpoint_id}']").count() == 1
    await admin.shot("endpoints")
    await page.click(f"a[href='/endpoints/{site.acme}']")
    await page.wait_for_url(f"**/endpoints/{site.acme}")
    assert "100.0 %" in await page.inner_text("main")
    await admin.shot("endpoint")

    await page.click("header nav >> text=Deliveries")
    await page.wait_for_url("**/deliveries")
    assert await page.locator("table.deliveries tbody tr").count() == 50
    await admin.shot("deliveries")
    await page.click("#older")
    await page.wait_for_url("**cursor=*")
    # 55 bulk + the XSS event's 2 + bolt's 1 = 58 deliveries: 8 on the second page.
    assert await page.locator("table.deliveries tbody tr").count() == 8
    await page.fill("input[name=stream_id]", "xss")
    await page.click("#search button[type=submit]")
    assert await page.locator("table.deliveries tbody tr").count() == 2
    await page.select_option("select[name=status]", "dead_letter")
    await page.click("#search button[type=submit]")
    assert await page.locator("table.deliveries tbody tr").count() == 1
    await admin.open("/deliveries?event_type=bolt.only&tenant=bolt")
    assert await page.locator("table.deliveries tbody tr").count() == 1
    await admin.open("/deliveries?default_tenant=1")
    assert await page.locator("#none").count() == 1
    await page.fill("input[name=delivery_id]", site.xss_delivery)
    await page.click("#search button[type=submit]")
    await page.wait_for_url(f"**/deliveries/{site.xss_delivery}")

    # The payload and the response body: visible as text, never run.
    payload = await page.locator("#payload").inner_text()
    assert XSS_PAYLOAD["note"] in payload.replace('\\"', '"')
    assert "onerror" in payload
    body = await page.locator("pre.response").first.inner_text()
    assert body == XSS_RESPONSE
    assert (
        await page.locator("#payload script, #payload img, #attempts img, #attempts b").count() == 0
    )
    assert await admin.pwned() is None and admin.dialogs == []
    await admin.shot("delivery")
    await page.click("a[href^='/events/']")
    await page.wait_for_url("**/events/*")
    assert await page.locator("table.deliveries tbody tr").count() == 2
    assert await admin.pwned() is None and admin.dialogs == []
    await admin.shot("event")
    response = await page.goto(site.api.url + "/")
    assert response is not None
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe" not in csp
    assert response.headers["x-frame-options"] == "DENY"
    # Every page above loaded without an error in the console: no resource missing (the
    # icon included), no script failing, nothing the Content-Security-Policy blocked.
    assert admin.console_errors == []


async def test_replay_disable_enable_rotate_and_recover(admin: Tab, site: Site) -> None:
    page, database_url = admin.page, site.api.database_url
    await admin.open(f"/deliveries/{site.xss_delivery}")
    # The trace its attempts are in (none stored: the delivery's own), as the API says it.
    detail = await site.api.get(f"/api/v1/deliveries/{site.xss_delivery}")
    assert await page.locator("#trace-id").inner_text() == detail.body["trace_id"]
    assert len(detail.body["trace_id"]) == 32
    await page.click("#replay button")
    await page.wait_for_url("**done=replayed")
    assert await page.locator(".flash").inner_text() == "Replay queued under the same delivery id."
    assert await page.locator("#status").inner_text() == "retrying"  # due again, same id
    rows = await scalar(
        database_url,
        "SELECT count(*) FROM webhook_outbox WHERE delivery_id = %s AND replay",
        (site.xss_delivery,),
    )
    assert rows == 1

    await admin.open(f"/endpoints/{site.acme}")
    await page.click("button[data-action=disable]")
    await page.wait_for_url("**done=disabled")
    assert "disabled" in await page.locator("h1 .state").inner_text()
    await admin.shot("endpoint-disabled")
    await page.click("button[data-action=enable]")
    await page.wait_for_url("**done=enabled")
    assert await page.locator("h1 .state").inner_text() == "enabled"

    before = await scalar(
        database_url, "SELECT secret FROM webhook_endpoints WHERE id = %s", (site.acme,)
    )
    async with page.expect_response(lambda r: r.url.endswith("/rotate")) as answer:
        await page.click("button[data-action=rotate]")
    assert (await answer.value).headers["cache-control"] == "no-store"  # kept nowhere
    secret = await page.locator("#new-secret").inner_text()
    stored = await scalar(
        database_url, "SELECT secret FROM webhook_endpoints WHERE id = %s", (site.acme,)
    )
    assert secret == stored != before and secret.startswith("whsec_")
    assert await page.locator("#kept").inner_text() == "24h"  # the default, as the API's
    await admin.shot("secret")
    await admin.open(f"/endpoints/{site.acme}")
    assert secret not in await page.content()  # shown once
    # After a leak: the old secret stops signing at once.
    await page.select_option("#keep-previous", "0")
    await page.click("button[data-action=rotate]")
    await page.wait_for_selector("#new-secret")
    assert await page.locator("#kept").inner_text() == "stopped signing now"
    ended = await scalar(
        database_url,
        "SELECT previous_until <= now() AND secret_previous = %s FROM webhook_endpoints"
        " WHERE id = %s",
        (secret, site.acme),
    )
    assert ended is True

    await admin.open(f"/endpoints/{site.acme_failing}")
    await page.fill("#since", "1h")
    await page.click("#recover button")
    await page.wait_for_url("**done=recovered**")
    assert "Requeued 1 dead letter(s)" in await page.locator(".flash").inner_text()
    assert await admin.pwned() is None and admin.dialogs == []


async def test_a_tenant_sees_its_own_portal_only(browser: Browser, site: Site) -> None:
    async for tab in signed_in(browser, site, "acme"):
        page = tab.page
        assert "tenant portal: acme" in await page.inner_text("header")
        pages = ["/", "/endpoints", "/deliveries", f"/endpoints/{site.acme}"]
        pages += [f"/deliveries/{site.xss_delivery}", "/deliveries?stream_id=bolt-secret-stream"]
        for path in pages:
            await tab.open(path)
            html = await page.content()
            html = html.replace('value="bolt-secret-stream"', "")  # the search, echoed
            for foreign in (site.bolt, site.bolt_delivery, "bolt-secret-stream", "bolt.only"):
                assert foreign not in html, path
        await tab.open("/deliveries")
        await tab.shot("portal-deliveries")
        assert await page.locator("input[name=tenant]").count() == 0
        for path in (f"/endpoints/{site.bolt}", f"/deliveries/{site.bolt_delivery}"):
            response = await page.goto(site.api.url + path)
            assert response is not None and response.status == 404, path
        await tab.open("/endpoints")
        assert await page.locator("tr[data-endpoint]").count() == 2
        await tab.shot("portal-endpoints")
        assert await tab.pwned() is None and tab.dialogs == []


async def test_read_only_and_forged_forms_change_nothing(browser: Browser, site: Site) -> None:
    async for tab in signed_in(browser, site, "acme_reader"):
        page = tab.page
        await tab.open(f"/endpoints/{site.acme}")
        assert await page.locator("button[data-action]").count() == 0
        await tab.open(f"/deliveries/{site.xss_delivery}")
        assert await page.locator("#replay").count() == 0
        csrf = await page.locator("header input[name=csrf]").get_attribute("value")
        assert csrf
        forged = await page.request.post(
            site.api.url + f"/endpoints/{site.acme}/disable", form={"csrf": csrf}
        )
        assert forged.status == 403
    async for tab in signed_in(browser, site, "admin"):
        # A form without the session's CSRF token (as another site would post it).
        forged = await tab.page.request.post(
            site.api.url + f"/endpoints/{site.acme}/disable", form={"csrf": "guess"}
        )
        assert forged.status == 403
        state = await scalar(
            site.api.database_url, "SELECT state FROM webhook_endpoints WHERE id = %s", (site.acme,)
        )
        assert state == "enabled"
        await tab.page.click("header button[type=submit]")  # sign out
        await tab.page.wait_for_url("**/login")
        await tab.open("/endpoints")
        assert tab.page.url.endswith("/login")


async def test_a_removed_endpoints_deliveries_neither_link_to_it_nor_offer_a_replay(
    admin: Tab, site: Site
) -> None:
    """A delivery outlives its endpoint's removal: its pages say the endpoint was removed,
    with no link to a page that is gone and no Replay button the API would refuse."""
    page = admin.page
    assert (await site.api.call("DELETE", f"/api/v1/endpoints/{site.bolt}")).status == 204
    await admin.open(f"/deliveries/{site.bolt_delivery}")
    assert await page.locator("#replay").count() == 0
    assert await page.locator(f"a[href='/endpoints/{site.bolt}']").count() == 0
    assert "(removed" in await page.inner_text("main")
    event_link = page.locator("a[href^='/events/']")
    await event_link.click()
    await page.wait_for_url("**/events/*")
    assert await page.locator(f"a[href='/endpoints/{site.bolt}']").count() == 0
    await admin.open("/deliveries?tenant=bolt")
    assert await page.locator("table.deliveries tbody tr").count() == 1
    assert await page.locator(f"a[href='/endpoints/{site.bolt}']").count() == 0
    # An endpoint that still exists keeps its links and its button.
    await admin.open(f"/deliveries/{site.xss_delivery}")
    assert await page.locator("#replay").count() == 1
    assert await page.locator(f"a[href='/endpoints/{site.acme}']").count() == 1
    assert admin.console_errors == []
