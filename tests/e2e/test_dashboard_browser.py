"""The dashboard in a real browser (Debian's Chromium driven by Playwright): sign in with
a token, every page, replay, disable and enable, rotate (the secret shown once), recover;
stored markup (a payload with <script> and onerror=, a response body with markup) is shown
as text and never runs; a tenant's token sees its own portal only; a read-only token and
a forged form change nothing. A screenshot of each page goes to test-artifacts/."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from aiohttp import web
from playwright.async_api import Browser, Dialog, Locator, Page, expect

from tests.support.api import LOOPBACK, Api, serving
from tests.support.dispatch import make_settings, running_dispatcher, scalar, wait_until
from tests.support.receiver import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

SHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
XSS_PAYLOAD = {
    "note": "<script>window.__pwned = 'script'; alert('script')</script>",
    "img": "<img src=x onerror=\"window.__pwned = 'onerror'; alert('onerror')\">",
}
XSS_RESPONSE = "<img src=x onerror=\"window.__pwned='response'\"><b>bold?</b>"
BULK = 55  # more than one page of the dashboard's list (50)


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
            # The bulk deliveries as if each took 15 s from its enqueue: the latency chart's
            # scale goes to "20,000 ms", a label longer than the chart's least left margin.
            slowed = await scalar(
                database_url,
                "WITH u AS (UPDATE webhook_outbox"
                " SET enqueued_at = processed_at - interval '15 seconds'"
                " WHERE outcome = 'delivered' AND stream_id LIKE 'bulk-%' RETURNING 1)"
                " SELECT count(*) FROM u",
            )
            assert slowed == BULK
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
    await page.click("button[data-action=rotate]")  # asks first
    await page.wait_for_url(f"**/endpoints/{site.acme}/rotate?keep_previous=24h")
    async with page.expect_response(lambda r: r.url.endswith("/rotate")) as answer:
        await page.click("button[data-action=confirm-rotate]")
    assert (await answer.value).headers["cache-control"] == "no-store"  # kept nowhere
    secret = await page.locator("#new-secret").input_value()
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
    await page.click("button[data-action=confirm-rotate]")
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


async def focused(page: Page) -> Any:
    """The element with the focus: its id, data-action and aria-describedby."""
    return await page.evaluate(
        "() => { const e = document.activeElement; return e && [e.id,"
        " e.getAttribute('data-action'), e.getAttribute('aria-describedby')]; }"
    )


async def test_an_actions_result_is_in_the_title_and_the_focus_starts_there(
    admin: Tab, site: Site
) -> None:
    """After Disable, Enable, Replay or Recover, the page says the result in its title
    (read as it loads) and the keyboard goes on from it: on the list, from the endpoint's
    own row (its button, described by the result); elsewhere, from the result."""
    page = admin.page
    await admin.open("/endpoints")
    button = page.get_by_role("button", name=f"Disable {site.acme}", exact=True)
    await button.focus()
    await page.keyboard.press("Enter")
    await page.wait_for_url(f"**/endpoints?done=disabled#ep-{site.acme}")
    assert await page.title() == "Endpoint disabled · Endpoints · fluxora-webhooks"
    toggle = page.get_by_role("button", name=f"Enable {site.acme}", exact=True)
    await expect(toggle).to_be_focused()
    await expect(toggle).to_have_accessible_description(re.compile("^Endpoint disabled: "))

    await admin.open(f"/endpoints/{site.acme}")
    assert await page.title() == f"Endpoint {site.acme} · fluxora-webhooks"
    await page.get_by_role("button", name=f"Enable {site.acme}").click()
    await page.wait_for_url("**done=enabled")
    assert await page.title() == f"Endpoint enabled · Endpoint {site.acme} · fluxora-webhooks"
    assert await focused(page) == ["flash", None, None]
    await expect(page.locator("#flash")).to_have_attribute("tabindex", "-1")

    await admin.open(f"/deliveries/{site.xss_delivery}")
    await page.get_by_role("button", name="Replay").click()
    await page.wait_for_url("**done=replayed")
    assert await page.title() == f"Replay queued · Delivery {site.xss_delivery} · fluxora-webhooks"
    assert await focused(page) == ["flash", None, None]

    assert admin.console_errors == []
    # A time that is no time: the form again (422), the focus on the field, which says why.
    await admin.open(f"/endpoints/{site.acme_failing}")
    await page.fill("#since", "yesterday-ish")
    await page.click("#recover button")
    await page.wait_for_load_state()
    since = page.get_by_role("textbox", name="since")
    await expect(since).to_be_focused()
    await expect(since).to_have_attribute("aria-invalid", "true")
    await expect(since).to_have_accessible_description(re.compile("neither an ISO 8601 time"))
    await admin.shot("recover-error")
    assert await page.title() == f"Error in since · Endpoint {site.acme_failing} · fluxora-webhooks"
    await since.fill("1h")
    await page.keyboard.press("Enter")
    await page.wait_for_url("**done=recovered**")
    assert await page.title() == (
        f"Requeued 1 dead letter(s) · Endpoint {site.acme_failing} · fluxora-webhooks"
    )
    assert await focused(page) == ["flash", None, None]


async def test_every_control_and_landmark_has_a_name_of_its_own(admin: Tab, site: Site) -> None:
    """A screen reader's lists of buttons, links and landmarks tell each one apart: the
    endpoint an action or a count is about, the event a number is, the window a short
    name stands for; the payload can be scrolled from the keyboard; the first Tab offers
    to skip to the content."""
    page = admin.page
    await admin.open("/")
    await page.keyboard.press("Tab")
    skip = page.get_by_role("link", name="Skip to the content")
    await expect(skip).to_be_focused()
    await page.keyboard.press("Enter")
    await expect(page.locator("main")).to_be_focused()
    await expect(page.get_by_role("navigation", name="Main")).to_have_count(1)
    windows = page.get_by_role("navigation", name="Time window")
    # The name holds the text shown (WCAG 2.5.3: a voice user says "click 15m").
    for short, name in (("15m", "15 minutes"), ("1h", "1 hour"), ("6h", "6 hours"),
                        ("24h", "24 hours"), ("7d", "7 days")):  # fmt: skip
        link = windows.get_by_role("link", name=f"{short} ({name})", exact=True)
        await expect(link).to_have_count(1)

    await admin.open("/endpoints")
    table = page.locator("#endpoints")
    await expect(table.get_by_role("columnheader", name="Actions")).to_have_count(1)
    for endpoint_id in (site.acme, site.acme_failing, site.bolt):
        for name in (f"Disable {endpoint_id}", f"Rotate secret… of {endpoint_id}"):
            await expect(page.get_by_role("button", name=name, exact=True)).to_have_count(1)
        pending = page.get_by_role("link", name=f"0 pending deliveries of {endpoint_id}")
        await expect(pending).to_have_count(1)
    # No Redis here: the breaker is unknown, and why is said, not only in a tooltip.
    unknown = table.locator(f"tr[data-endpoint='{site.acme}'] td").nth(5)
    await expect(unknown).to_have_text(re.compile(r"unknown \(\S"))

    # One page of endpoints: no empty Pagination landmark; more deliveries: one.
    await expect(page.get_by_role("navigation", name="Pagination")).to_have_count(0)
    await admin.open("/deliveries")
    await expect(page.get_by_role("navigation", name="Pagination")).to_have_count(1)
    await admin.open(f"/deliveries/{site.xss_delivery}")
    await expect(page.get_by_role("link", name=re.compile(r"^event \d+$"))).to_have_count(1)
    for region in ("Payload", "Response body of attempt 1"):
        scrolled = page.get_by_role("region", name=region, exact=True)
        await scrolled.focus()
        await expect(scrolled).to_be_focused()
        await expect(scrolled).to_have_attribute("tabindex", "0")
    assert admin.console_errors == []


async def test_a_rotation_is_asked_first_and_its_secret_can_be_copied_anyhow(
    admin: Tab, site: Site
) -> None:
    """The old secret's time comes before Rotate in the keyboard's order; Rotate asks
    first; the new secret is a field a keyboard can select, and Copy works (and says so)
    where the page has no clipboard API (plain http on another host than localhost)."""
    page, database_url = admin.page, site.api.database_url

    async def stored() -> Any:
        query = "SELECT secret FROM webhook_endpoints WHERE id = %s"
        return await scalar(database_url, query, (site.acme,))

    before = await stored()
    await admin.open(f"/endpoints/{site.acme}")
    await page.get_by_role("button", name=f"Disable {site.acme}").focus()
    await page.keyboard.press("Tab")
    await expect(page.get_by_label("old one signs for")).to_be_focused()
    await page.select_option("#keep-previous", "0")
    await page.keyboard.press("Tab")
    await expect(page.get_by_role("button", name=f"Rotate secret… of {site.acme}")).to_be_focused()
    await page.keyboard.press("Enter")
    await page.wait_for_url("**/rotate?keep_previous=0")
    assert await stored() == before  # asked, nothing done
    assert await page.title() == f"Rotate the secret of {site.acme} · fluxora-webhooks"
    await expect(page.locator("#leak-warning")).to_be_visible()
    await admin.shot("rotate-confirm")
    await expect(page.get_by_label("The old secret keeps signing for")).to_have_value("0")
    await page.get_by_role("button", name="Rotate the secret").click()
    field = page.get_by_role("textbox", name="New secret")
    await expect(field).to_have_attribute("readonly", "")
    secret = await field.input_value()
    assert secret == await stored() != before and secret.startswith("whsec_")
    await field.focus()  # selected whole, for Ctrl+C
    span = await field.evaluate("f => [f.selectionStart, f.selectionEnd]")
    assert span == [0, len(secret)]

    status = page.get_by_role("status").filter(has_text=re.compile("Cop"))
    await page.evaluate("() => Object.defineProperty(navigator, 'clipboard', {value: undefined})")
    await page.evaluate("() => document.getSelection().removeAllRanges()")
    await page.get_by_role("button", name="Copy").click()
    await expect(page.locator("#copy-status")).to_have_text("Copied")
    span = await field.evaluate("f => [f.selectionStart, f.selectionEnd]")
    assert span == [0, len(secret)]  # what was copied, still selected
    await page.evaluate("() => { document.execCommand = () => false; }")
    await page.get_by_role("button", name="Copy").click()
    await expect(status).to_have_text("Copy failed: select the secret and press Ctrl+C")
    assert admin.console_errors == []


CONTRAST = """(samples) => {
  const rgb = (c) => (c.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => [r, g, b].map((v) => v / 255)
    .map((v) => (v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4))
    .reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p);
    return (x + 0.05) / (y + 0.05); };
  const background = (e) => { for (; e; e = e.parentElement) {
      const c = getComputedStyle(e).backgroundColor; const v = rgb(c);
      if (v.length === 3 || v[3] > 0) return v.slice(0, 3); }
    return [255, 255, 255]; };
  const main = document.querySelector("main");
  return samples.map(([tag, cls, where]) => {
    const e = document.createElement(tag); e.className = cls; e.textContent = "sample";
    (where === "card" ? main.querySelector(".card") : main).appendChild(e);
    const s = getComputedStyle(e);
    const own = background(e), around = background(e.parentElement);
    return [cls || tag, ratio(rgb(s.color), own),
            Math.min(ratio(rgb(s.borderTopColor), own), ratio(rgb(s.borderTopColor), around))];
  });
}"""


async def test_text_and_controls_stand_out_from_their_background(admin: Tab, site: Site) -> None:
    """Every state's badge, a warning button and the muted text have 4.5:1 against
    their background; fields' and buttons' edges 3:1 against theirs (WCAG AA)."""
    page = admin.page
    await admin.open(f"/endpoints/{site.acme}")
    badges = ["s-enabled", "s-disabled", "b-closed", "b-open", "b-half-open"]
    badges += [f"d-{s}" for s in ("delivered", "dead_letter", "retrying", "retry", "parked")]
    badges += ["d-pending"]
    samples = [["span", f"state {b}", "card"] for b in badges]
    samples += [["p", "muted", "main"], ["p", "muted", "card"], ["p", "error", "main"]]
    samples += [["button", "warn", "main"], ["button", "", "main"], ["input", "", "main"]]
    samples += [["select", "", "main"], ["button", "", "card"], ["input", "", "card"]]
    measured = await page.evaluate(CONTRAST, samples)
    for (tag, cls, where), (name, text, edge) in zip(samples, measured, strict=True):
        if tag in ("span", "p") or cls == "warn":
            assert text >= 4.5, (name, where, round(text, 2))
        if tag in ("button", "input", "select"):
            assert edge >= 3, (name, where, round(edge, 2))


async def test_the_pages_fit_a_320_pixel_wide_window(admin: Tab, site: Site) -> None:
    """At 320 CSS pixels (400 % zoom of a 1280 px window) nothing needs scrolling
    sideways but a wide table itself: the header wraps, Sign out stays on screen."""
    page = admin.page
    await page.set_viewport_size({"width": 320, "height": 640})
    pages = {
        "overview": "/",
        "endpoints": "/endpoints",
        "endpoint": f"/endpoints/{site.acme}",
        "deliveries": "/deliveries",
        "delivery": f"/deliveries/{site.xss_delivery}",
    }
    for name, path in pages.items():
        await admin.open(path)
        await admin.shot(f"narrow-{name}")
        wide = await page.evaluate(
            "() => Array.from(document.querySelectorAll('body *'))"
            ".filter(e => !e.closest('.scroll') && e.getBoundingClientRect().right > 321)"
            ".map(e => e.tagName + '.' + e.className).slice(0, 5)"
        )
        assert wide == [], (path, wide)
        assert await page.evaluate("() => document.documentElement.scrollWidth") <= 320, path
        box = await page.get_by_role("button", name="Sign out").bounding_box()
        assert box is not None and box["x"] + box["width"] <= 320, path
    assert admin.console_errors == []


async def test_each_charts_lines_differ_in_more_than_colour_and_have_a_table(
    admin: Tab, site: Site
) -> None:
    """The lines of a chart have dash patterns of their own (as its legend shows them),
    and the chart's values are a table too, behind a disclosure."""
    page = admin.page
    await admin.open("/")
    charts = page.locator("figure.chart")
    await expect(charts).to_have_count(4)
    throughput = charts.first
    dashes = await throughput.locator("svg.plot polyline").evaluate_all(
        "ps => ps.map(p => getComputedStyle(p).strokeDasharray)"
    )
    assert len(dashes) == 3 and len(set(dashes)) == 3, dashes
    keys = await throughput.locator(".legend svg line").evaluate_all(
        "ls => ls.map(l => getComputedStyle(l).strokeDasharray)"
    )
    assert keys == dashes
    table = throughput.get_by_role("table")
    await expect(table).to_be_hidden()
    await throughput.get_by_text("Table of the values").click()
    await expect(table).to_be_visible()
    heads = await table.locator("thead th").all_inner_texts()
    assert heads == ["bucket until", "delivered", "retry", "dead letter"]
    await expect(table.locator("tbody tr")).to_have_count(30)
    for chart in await charts.all():
        await expect(chart.locator("details table tbody tr")).to_have_count(30)


async def test_each_charts_labels_are_inside_it_and_its_legend_says_what_it_counts(
    admin: Tab, site: Site
) -> None:
    """Every text of a chart is drawn inside its SVG's viewBox, the long "20,000 ms" of
    the latency scale too; a legend names what its number is: the window's total of a
    count (the card's number), the backlog now, a latency's latest bucket."""
    page = admin.page

    def card(title: str) -> Locator:
        return page.locator(".card", has=page.get_by_role("heading", name=title))

    for window, name, bucket in (("1h", "hour", "2 min"), ("15m", "15 minutes", "30 s")):
        await admin.open(f"/?window={window}")
        outside = await page.locator("svg.plot").evaluate_all(
            """svgs => svgs.flatMap(svg => {
                const v = svg.viewBox.baseVal;
                return [...svg.querySelectorAll("text")].map(t => [t.textContent, t.getBBox()])
                    .filter(([, b]) => b.x < v.x || b.y < v.y || b.x + b.width > v.x + v.width
                                       || b.y + b.height > v.y + v.height)
                    .map(([text, b]) => `${text} at ${b.x},${b.y} ${b.width}x${b.height}`);
            })"""
        )
        assert outside == [], outside
        charts = page.locator("figure.chart")
        latency = charts.nth(1)
        await expect(latency.locator("svg.plot text").first).to_have_text("20,000 ms")
        legends = [await c.locator(".legend li").all_inner_texts() for c in await charts.all()]
        # The totals are the cards' numbers of the same window.
        delivered = await card(f"Delivered ({window})").locator(".big").inner_text()
        failed = await card(f"Failed attempts ({window})").locator(".muted").inner_text()
        found = re.fullmatch(r"(\d+) retried · (\d+) dead-lettered", failed)
        assert found is not None, failed
        assert legends[0] == [
            f"delivered: {delivered} in the last {name}",
            f"retry: {found[1]} in the last {name}",
            f"dead letter: {found[2]} in the last {name}",
        ], legends[0]
        latest = rf"[\d,.]+ ms in the (last {bucket}|{bucket} to .+)"
        assert len(legends[1]) == 2, legends[1]
        assert re.fullmatch(f"p50: {latest}", legends[1][0]), legends[1]
        assert re.fullmatch(f"p95: {latest}", legends[1][1]), legends[1]
        assert legends[2] == ["pending deliveries: 0 now"], legends[2]
        assert re.fullmatch(rf"dead-lettered: \d+ in the last {name}", legends[3][0]), legends[3]
    assert admin.console_errors == []
