"""The request rate limit per credential (WEBHOOK_API_RATE_LIMIT, docs/api.md, "Request rate
limit"): past it a 429 in the error shape with Retry-After, the RateLimit-* headers on every
answer, a bucket that refills, tokens and sessions independent of each other, invented
tokens counted against their address, probes and static files never limited, and a bad
value that stops start-up naming the variable."""

from __future__ import annotations

import asyncio
import re
import secrets

import aiohttp
import psycopg
import pytest

from tests.support.api import Api, Reply, serving
from tests.support.procs import command_env, run_command

pytestmark = pytest.mark.integration

# A bucket of 5 that refills by 5 an hour: within a test, 5 requests and no more.
FIVE = (5, 3_600_000)
EVENT = {"tenant": "acme", "stream_id": "s-1", "event_type": "a.b", "payload": {"n": 1}}


def limited(reply: Reply) -> None:
    """A 429 as a client relies on it: the error shape, when to come back, the headers."""
    assert reply.status == 429, reply.text
    assert reply.error_code == "rate_limited"
    assert "try again in" in reply.body["error"]["message"]
    assert int(reply.headers["retry-after"]) >= 1
    assert reply.headers["ratelimit-remaining"] == "0"
    assert reply.headers["content-security-policy"].startswith("default-src 'none'")


async def until_limited(api: Api, token: str | None, bound: int = 50) -> list[Reply]:
    """Requests until the first 429 (within ``bound``): every answer, the 429 last."""
    replies = []
    for _ in range(bound):
        reply = await api.get("/api/v1/endpoints", token=token)
        replies.append(reply)
        if reply.status == 429:
            return replies
    raise AssertionError(f"no 429 in {bound} requests: {[r.status for r in replies]}")


async def test_past_the_limit_a_token_is_answered_429_and_the_request_does_nothing(
    database_url: str,
) -> None:
    async with serving(database_url, rate_limit=FIVE) as api:
        replies = [await api.get("/api/v1/endpoints", token="acme") for _ in range(4)]
        assert [r.status for r in replies] == [200] * 4
        assert [r.headers["ratelimit-limit"] for r in replies] == ["5"] * 4
        assert [r.headers["ratelimit-remaining"] for r in replies] == ["4", "3", "2", "1"]
        assert all(int(r.headers["ratelimit-reset"]) > 0 for r in replies)
        sent = await api.post("/api/v1/events", token="acme", json=EVENT)
        assert sent.status == 202, sent.text
        assert sent.headers["ratelimit-remaining"] == "0"

        refused = await api.post("/api/v1/events", token="acme", json=EVENT)
        limited(refused)
        assert refused.headers["ratelimit-limit"] == "5"
        limited(await api.get("/api/v1/endpoints", token="acme"))
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            row = await (await conn.execute("SELECT count(*) FROM webhook_outbox")).fetchone()
        assert row == (1,)  # the refused event was not enqueued
    assert api.tokens["acme"] not in "".join(api.seen)


async def test_the_bucket_refills(database_url: str) -> None:
    # 3 at once, then one a second.
    async with serving(database_url, rate_limit=(3, 3000)) as api:
        replies = await until_limited(api, "acme")
        assert [r.status for r in replies[:3]] == [200, 200, 200]
        wait_s = int(replies[-1].headers["retry-after"])
        await asyncio.sleep(wait_s)
        again = await api.get("/api/v1/endpoints", token="acme")
        assert again.status == 200, again.text
        assert int(again.headers["ratelimit-limit"]) == 3


async def test_two_tokens_and_a_session_are_limited_independently(database_url: str) -> None:
    async with serving(database_url, rate_limit=FIVE) as api:
        flooded = await until_limited(api, "acme")
        assert [r.status for r in flooded] == [200] * 5 + [429]
        for _ in range(5):  # bolt has its own five
            reply = await api.get("/api/v1/endpoints", token="bolt")
            assert reply.status == 200, reply.text
        limited(await api.get("/api/v1/endpoints", token="bolt"))
        limited(await api.get("/api/v1/endpoints", token="acme"))

        # A dashboard session has its own bucket too (the sign-in form's two requests count
        # against the address, which the tokens above never used up).
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as browser:
            async with browser.get(api.url + "/login") as resp:
                assert resp.status == 200
                nonce = re.search(r'name="nonce" value="([^"]+)"', await resp.text())
            assert nonce is not None
            form = {"token": api.tokens["admin"], "nonce": nonce.group(1)}
            async with browser.post(api.url + "/login", data=form, allow_redirects=False) as r:
                assert r.status == 303, await r.text()
            statuses = []
            for _ in range(6):
                async with browser.get(api.url + "/endpoints", allow_redirects=False) as resp:
                    statuses.append(resp.status)
                    page, headers = await resp.text(), resp.headers
            assert statuses == [200] * 5 + [429]
            assert headers["Content-Type"].startswith("text/html")
            assert int(headers["Retry-After"]) >= 1
            assert "Too many requests" in page and api.tokens["admin"] not in page
        # The admin token's API requests are not the session's.
        assert (await api.get("/api/v1/endpoints", token="admin")).status == 200


async def test_invented_tokens_are_counted_against_their_address(database_url: str) -> None:
    """A client that sends a new token each time gets no fresh bucket each time: until a
    token authenticates, its requests count against the client's address."""
    async with serving(database_url, rate_limit=FIVE, failed_auth_per_s=1000.0) as api:
        await api.get("/api/v1/endpoints", token="acme")  # acme's bucket, from now on
        statuses = []
        for _ in range(6):
            invented = "fxa_" + secrets.token_urlsafe(32)
            statuses.append((await api.get("/api/v1/endpoints", token=invented)).status)
        assert statuses == [401] * 5 + [429]
        limited(await api.get("/api/v1/endpoints", token=None))
        # A token that has authenticated keeps its own bucket meanwhile.
        assert (await api.get("/api/v1/endpoints", token="acme")).status == 200


async def test_probes_and_static_files_are_not_limited(database_url: str) -> None:
    async with serving(database_url, rate_limit=(2, 3_600_000)) as api:
        async with aiohttp.ClientSession() as session:
            for path in ("/healthz", "/readyz", "/static/app.css") * 10:
                async with session.get(api.url + path) as resp:
                    assert resp.status == 200, path
                    assert "RateLimit-Remaining" not in resp.headers, path
        # Nothing above was counted: the address and the token have their whole burst.
        first = await api.get("/api/v1/endpoints", token="admin")
        assert first.status == 200 and first.headers["ratelimit-remaining"] == "1"
        no_token = await api.get("/api/v1/endpoints", token=None)
        assert no_token.status == 401 and no_token.headers["ratelimit-remaining"] == "1"


async def test_a_bad_value_stops_start_up_naming_the_variable(database_url: str) -> None:
    # Each bad form: tests/unit/test_api_rate_limit.py. Here: both commands stop on one.
    env = command_env(DATABASE_URL=database_url, WEBHOOK_API_PORT="0", WEBHOOK_API_RATE_LIMIT="20")
    for command in ("api", "run"):
        code, out = await run_command(command, env=env, timeout=30)
        assert code == 2, out
        assert "WEBHOOK_API_RATE_LIMIT" in out, out


async def test_a_token_refused_on_its_address_is_told_why(database_url: str) -> None:
    """A valid token whose first request comes from an address other clients used up is
    refused against that address: the message says so, not that its token is over."""
    async with serving(database_url, rate_limit=FIVE, failed_auth_per_s=1000.0) as api:
        statuses = [(await api.get("/api/v1/endpoints", token=None)).status for _ in range(5)]
        assert statuses == [401] * 5
        refused = await api.get("/api/v1/endpoints", token="acme")
        limited(refused)
        message = refused.body["error"]["message"]
        assert message.startswith("too many requests from this client address"), message
        assert "until it has authenticated" in message
        assert "at most 5 per" in message
