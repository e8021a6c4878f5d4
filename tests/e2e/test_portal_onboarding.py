"""A customer onboards itself in the tenant portal, in a real browser (Debian's Chromium
driven by Playwright), with nothing but its tenant token: adds its first endpoint (a bad
URL marked at its field), copies the secret shown once, sends it an event and verifies the
delivery with that secret, changes its settings, meets its tenant's cap, and removes an
endpoint after being asked. Another tenant's endpoint stays out of reach, and a read-only
token gets no form."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import psycopg
import pytest
import pytest_asyncio
from playwright.async_api import Browser, Page, expect

from fluxora_webhooks import verify
from tests.support.api import LOOPBACK, Api, serving
from tests.support.dispatch import make_settings, running_dispatcher, wait_until
from tests.support.receiver import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

CAP = 2


@pytest_asyncio.fixture(loop_scope="module")
async def api(database_url: str) -> AsyncIterator[Api]:
    async with serving(database_url, max_endpoints_per_tenant=CAP) as running:
        yield running


async def portal(browser: Browser, api: Api, token: str) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1200, "height": 900})
    page = await context.new_page()
    await page.goto(api.url + "/login")
    await page.fill("#token", api.tokens[token])
    await page.click("#login button[type=submit]")
    await page.wait_for_url(api.url + "/")
    try:
        yield page
    finally:
        await context.close()


async def add_endpoint(page: Page, api: Api, url: str, tenant: str | None = None) -> None:
    await page.goto(api.url + "/endpoints/new")
    if tenant is not None:
        await page.fill("#f-tenant", tenant)
    await page.fill("#f-url", url)
    await page.click("#endpoint-form button[type=submit]")


async def test_a_customer_adds_tests_changes_and_removes_its_endpoints(
    browser: Browser, api: Api, database_url: str
) -> None:
    receiver = Receiver()
    await receiver.start()
    others = await api.post(
        "/api/v1/endpoints", json={"url": "http://127.0.0.1:9/bolt", "tenant": "bolt"}
    )
    bolt = others.body["id"]
    try:
        async for page in portal(browser, api, "acme"):
            await page.click("header nav >> text=Endpoints")
            empty = page.locator("#no-endpoints")
            await expect(empty).to_contain_text("No endpoints yet")
            assert "fluxora-webhooks endpoints add" not in await empty.inner_text()
            await empty.get_by_role("link", name="Add one").click()
            await page.wait_for_url("**/endpoints/new")
            assert await page.locator("#f-tenant").count() == 0  # its own tenant only

            # A URL the policy refuses: the form again, as typed, the field marked.
            await page.fill("#f-url", "ftp://files.example.com/hook")
            await page.fill("#f-event_types", "invoice.*")
            await page.fill("#f-headers", "X-Team: billing")
            await page.click("#endpoint-form button[type=submit]")
            url_field = page.locator("#f-url")
            await expect(url_field).to_have_attribute("aria-invalid", "true")
            described = await url_field.get_attribute("aria-describedby") or ""
            assert "form-error" in described.split()
            await expect(page.locator("#form-error")).to_contain_text("URL: scheme")
            assert await page.input_value("#f-event_types") == "invoice.*"
            assert (await page.title()).startswith("Error in URL")

            await page.fill("#f-url", receiver.url)
            await page.click("#endpoint-form button[type=submit]")
            await expect(page.locator("h1")).to_contain_text("added")
            secret = await page.input_value("#new-secret")
            assert secret.startswith("whsec_")
            endpoint = page.url  # the answer to the post: the id is in the heading
            heading = await page.locator("h1 code").inner_text()
            assert endpoint.endswith("/endpoints/new") and heading.startswith("ep_")
            send = page.get_by_role("link", name="Send it an event")
            await expect(send).to_have_attribute("href", f"/events/new?endpoint_id={heading}")
            # A reload of that answer posts the form again: nothing more is added.
            await page.reload()
            await expect(page.locator("#added-before")).to_contain_text(heading)
            mine = await api.all_pages("/api/v1/endpoints", token="acme", limit=10)
            assert [e["id"] for e in mine] == [heading]
            listed = await api.get(f"/api/v1/endpoints/{heading}")
            assert listed.body["tenant"] == "acme"
            assert listed.body["headers"] == {"X-Team": "billing"}
            assert listed.body["event_types"] == ["invoice.*"]

            # An event to it: the type filled in from its subscription.
            await page.get_by_role("link", name="Go to the endpoint").click()
            await page.click("#send-event")
            assert await page.input_value("#f-event_type") == "invoice.test"
            await page.click("#event-form button[type=submit]")
            await page.wait_for_url("**/events/*")
            await expect(page.locator("#flash")).to_contain_text("Event sent")
            settings = make_settings("", allowed_networks=LOOPBACK, secret=b"")

            async def arrived() -> bool:
                return len(receiver.received) == 1

            async with running_dispatcher(settings, database_url):
                await wait_until(arrived, timeout=30, what="the test event")
            got = receiver.received[0]
            assert got.headers["x-team"] == "billing"
            assert got.headers["x-fluxora-event"] == "invoice.test"
            assert verify(got.body, got.headers, secret, scheme="standard") == got.delivery_id
            await page.reload()
            delivered = page.locator(f"a[href='/deliveries/{got.delivery_id}']")
            await expect(delivered).to_have_count(1)

            # Its settings changed; a bad line in the headers is marked, nothing saved.
            await page.goto(f"{api.url}/endpoints/{heading}")
            await page.click("#edit")
            assert await page.input_value("#f-headers") == "X-Team: billing"
            await page.fill("#f-event_types", "invoice.*, refund.created")
            await page.fill("#f-headers", "X-Team billing")
            await page.click("#endpoint-form button[type=submit]")
            await expect(page.locator("#f-headers")).to_have_attribute("aria-invalid", "true")
            await expect(page.locator("#f-headers")).to_be_focused()
            assert (await page.title()).startswith("Error in Custom headers")
            await expect(page.locator("#form-error")).to_contain_text("Custom headers: line 1")
            assert (await api.get(f"/api/v1/endpoints/{heading}")).body["event_types"] == [
                "invoice.*"
            ]
            await page.fill("#f-headers", "X-Team: payments")
            await page.fill("#f-description", "billing events")
            await page.click("#endpoint-form button[type=submit]")
            await page.wait_for_url(f"**/endpoints/{heading}?done=updated")
            await expect(page.locator("#flash")).to_contain_text("Endpoint changed")
            changed = (await api.get(f"/api/v1/endpoints/{heading}")).body
            assert changed["event_types"] == ["invoice.*", "refund.created"]
            assert changed["headers"] == {"X-Team": "payments"}
            assert changed["description"] == "billing events"
            assert changed["rate_limit"] is None and changed["ordered"] is False

            # Up to the tenant's cap, then told so.
            for n in range(2):
                await add_endpoint(page, api, f"http://127.0.0.1:9/more-{n}")
            await expect(page.locator("#form-error")).to_contain_text(
                f"the most it may have ({CAP})"
            )
            await expect(page.locator("#form-error")).to_be_focused()
            assert (await page.title()).startswith("Not saved")
            mine = await api.all_pages("/api/v1/endpoints", token="acme", limit=1)
            assert len(mine) == CAP
            second = next(e["id"] for e in mine if e["id"] != heading)

            # Removed after being asked (a post without the confirmation only asks).
            await page.goto(f"{api.url}/endpoints/{second}")
            await page.click("#remove-link")
            await expect(page.locator("#pending-note")).to_contain_text("no pending deliveries")
            assert (await api.get(f"/api/v1/endpoints/{second}")).status == 200
            await page.click("#remove button[type=submit]")
            await page.wait_for_url("**/endpoints?done=removed")
            await expect(page.locator("#flash")).to_contain_text("Endpoint removed")
            assert (await api.get(f"/api/v1/endpoints/{second}")).status == 404

            # Another tenant's endpoint: not found on every form, and left as it was.
            csrf = await page.locator("input[name=csrf]").first.input_value()
            for path in (f"/endpoints/{bolt}/edit", f"/endpoints/{bolt}/remove"):
                assert (await page.request.get(api.url + path)).status == 404
                posted = await page.request.post(
                    api.url + path,
                    form={"csrf": csrf, "confirm": "yes", "url": "https://evil.example/"},
                )
                assert posted.status == 404
            assert (await api.get(f"/api/v1/endpoints/{bolt}")).body["url"].endswith("/bolt")

        async for page in portal(browser, api, "acme_reader"):
            assert (await page.request.get(api.url + "/endpoints/new")).status == 403
            await page.goto(api.url + "/endpoints")
            assert await page.locator("#add-endpoint").count() == 0
    finally:
        await receiver.stop()


async def test_an_admin_adds_an_endpoint_and_sends_an_event_for_any_tenant(
    browser: Browser, api: Api
) -> None:
    async for page in portal(browser, api, "admin"):
        await page.goto(api.url + "/endpoints/new")
        await page.fill("#f-tenant", "bolt")
        await page.fill("#f-url", "http://127.0.0.1:9/bolt-hook")
        for typed in ("many", "1_000", "\u0663"):  # int() takes the last two
            await page.fill("#f-rate_limit", typed)
            await page.click("#endpoint-form button[type=submit]")
            await expect(page.locator("#f-rate_limit")).to_have_attribute("aria-invalid", "true")
        await page.fill("#f-rate_limit", "5")
        await page.check("#f-ordered")
        await page.click("#endpoint-form button[type=submit]")
        made = await page.locator("h1 code").inner_text()
        body = (await api.get(f"/api/v1/endpoints/{made}")).body
        assert (body["tenant"], body["rate_limit"], body["ordered"]) == ("bolt", 5, True)
        # A stored header the rules now refuse for new ones: a change of the description
        # alone keeps it, unchecked (as PATCH does).
        async with await psycopg.AsyncConnection.connect(api.database_url) as conn:
            await conn.execute(
                'UPDATE webhook_endpoints SET headers = \'{"Keep-Alive": "5"}\' WHERE id = %s',
                (made,),
            )
        await page.goto(f"{api.url}/endpoints/{made}/edit")
        await page.fill("#f-description", "kept as it was")
        await page.click("#endpoint-form button[type=submit]")
        await page.wait_for_url(f"**/endpoints/{made}?done=updated")
        kept = (await api.get(f"/api/v1/endpoints/{made}")).body
        assert (kept["headers"], kept["description"]) == ({"Keep-Alive": "5"}, "kept as it was")
        # One form posted twice at once (a double click without the script): one endpoint.
        await page.goto(api.url + "/endpoints/new")
        fields: dict[str, str | float | bool] = {
            "csrf": await page.locator("input[name=csrf]").first.input_value(),
            "form_key": await page.locator("input[name=form_key]").input_value(),
            "tenant": "twice",
            "url": "http://127.0.0.1:9/twice",
        }
        answers = await asyncio.gather(
            *(page.request.post(api.url + "/endpoints/new", form=fields) for _ in range(2))
        )
        assert sorted(a.status for a in answers) == [200, 409]
        twice = await api.all_pages("/api/v1/endpoints", tenant="twice")
        assert len(twice) == 1
        assert twice[0]["id"] in await next(a for a in answers if a.status == 409).text()
        # The admin is not capped, whatever the tenants' cap.
        for n in range(CAP):
            await add_endpoint(page, api, f"http://127.0.0.1:9/bolt-{n}", tenant="bolt")
            await expect(page.locator("h1")).to_contain_text("added")

        await page.goto(f"{api.url}/events/new?endpoint_id={made}")
        assert await page.input_value("#f-tenant") == "bolt"
        for payload in ("{not json", '{"a": 1e999}'):
            await page.fill("#f-payload", payload)
            await page.click("#event-form button[type=submit]")
            await expect(page.locator("#f-payload")).to_have_attribute("aria-invalid", "true")
            # Opened for an endpoint, the form stays that endpoint's.
            await expect(page.locator("#event-form + p a, #event-form a")).to_have_attribute(
                "href", f"/endpoints/{made}"
            )
        # enqueue's own check of the stream id, marked at its field too.
        csrf = await page.locator("input[name=csrf]").first.input_value()
        long_stream = await page.request.post(
            f"{api.url}/events/new?endpoint_id={made}",
            form={"csrf": csrf, "tenant": "bolt", "event_type": "a.b", "stream_id": "s" * 501,
                  "payload": "{}"},
        )  # fmt: skip
        assert long_stream.status == 422
        marked = await long_stream.text()
        assert 'id="f-stream_id" name="stream_id" value="' in marked
        assert re.search(r'id="f-stream_id"[^>]*aria-invalid="true"', marked)
        assert "Stream id: must be" in marked
        await page.fill("#f-payload", '{"amount": 42}')
        await page.click("#event-form button[type=submit]")
        await page.wait_for_url("**/events/*")
        event_id = page.url.split("/events/")[1].split("?")[0]
        event = (await api.get(f"/api/v1/events/{event_id}")).body
        assert (event["tenant"], event["event_type"], event["payload"]) == (
            "bolt",
            "webhook.test",
            {"amount": 42},
        )
