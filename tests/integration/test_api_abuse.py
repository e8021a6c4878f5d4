"""The API under a careless or hostile client (docs/api.md, "Limits"): a client that
trickles its request head or sends nothing is disconnected, a head past the bound is a 431,
a trickled body a 408 that held no database connection, connections past the bound are
closed, a request without a token is answered without a database connection, and failed
authentications (API or sign-in form) are answered at a bounded rate, holding no
connection. Every other request is answered meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from typing import Any

import aiohttp
import pytest

from fluxora_webhooks.api import server as api_server
from tests.support.api import Api, serving

pytestmark = pytest.mark.integration

# Bounds of the waits below: an answer, or a failed test, never a hang.
WAIT_S = 20.0


def _pool(api: Api) -> Any:
    assert api.server is not None and api.server._server is not None
    app: Any = api.server._server.config.app
    return app.state.fluxora.pool


async def _open(api: Api) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = api.url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), WAIT_S)


async def test_a_silent_or_trickling_client_is_disconnected_while_others_are_answered(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_server._Protocol, "head_timeout_s", 1.0)
    async with serving(database_url) as api:
        silent = await _open(api)  # connects and sends nothing
        trickling = await _open(api)  # starts a request and never ends its head
        trickling[1].write(b"GET /api/v1/endpoints HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        await trickling[1].drain()

        assert (await api.get("/api/v1/endpoints")).status == 200

        answered = await _answer(trickling[0])
        assert answered.startswith(b"HTTP/1.1 408 "), answered
        assert await _answer(silent[0]) == b""  # closed
        for _, writer in (silent, trickling):
            writer.close()
        assert (await api.get("/api/v1/endpoints")).status == 200


async def test_a_request_head_past_the_bound_is_refused(database_url: str) -> None:
    async with serving(database_url) as api:
        for head in (
            b"X-Big: " + b"a" * 200_000 + b"\r\n",  # one long header
            b"X-A: b\r\n" * 20_000,  # many short ones
        ):
            reader, writer = await _open(api)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
            answered = await _answer(reader)
            writer.close()
            assert answered.startswith(b"HTTP/1.1 431 "), answered[:100]
        # A long head within the bound is served.
        reply = await api.get("/api/v1/endpoints", headers={"X-Long": "a" * 30_000})
        assert reply.status == 200, reply.text


async def test_a_trickled_body_is_answered_408_and_holds_no_database_connection(
    database_url: str,
) -> None:
    async with serving(database_url, pool_max=1, body_timeout_s=1.0) as api:
        reader, writer = await _open(api)
        writer.write(
            b"POST /api/v1/events HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {api.tokens['acme']}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        await writer.drain()
        # The pool's one connection is free for others while the body trickles.
        assert (await api.get("/api/v1/endpoints", token="acme")).status == 200

        answered = await _answer(reader)
        writer.close()
        head, _, body = answered.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), answered
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert (await api.get("/api/v1/events", token="acme")).body["data"] == []


async def test_connections_past_the_bound_are_closed_and_others_served_after(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_server._Protocol, "max_connections", 3)
    async with serving(database_url) as api:
        idle = [await _open(api) for _ in range(3)]
        extra = await _open(api)
        assert await asyncio.wait_for(extra[0].read(), WAIT_S) == b""  # closed at once
        extra[1].close()
        for _, writer in idle:
            writer.close()
            await writer.wait_closed()
        for _ in range(100):
            if len(api.server._server.server_state.connections) == 0:  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.05)
        assert (await api.get("/api/v1/endpoints")).status == 200


async def test_a_request_without_a_valid_looking_token_takes_no_database_connection(
    database_url: str,
) -> None:
    async with serving(database_url, pool_max=1) as api:
        async with _pool(api).connection():  # held: a request needing one would wait
            for token in (None, "x" * 300):
                reply = await asyncio.wait_for(api.get("/api/v1/stats", token=token), WAIT_S)
                assert reply.status == 401, reply.text
                assert reply.error_code == "unauthorized"
                assert reply.headers.get("www-authenticate", "").startswith("Bearer")
        wrong = await api.get("/api/v1/stats", token="fxa_" + "0" * 43)
        assert wrong.status == 401


async def _still_waiting(task: asyncio.Task[Any]) -> bool:
    await asyncio.sleep(0)
    done = task.done()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
        await task
    return not done


async def test_failed_authentications_wait_their_turn_holding_no_connection(
    database_url: str,
) -> None:
    """Past the first, a failed authentication (no token, a wrong one) waits its turn
    (here one in 1000 s), with no database connection held: requests with a valid token
    are answered meanwhile. Nothing is locked out."""
    async with serving(database_url, pool_max=1, failed_auth_per_s=0.001) as api:
        first = await asyncio.wait_for(api.get("/api/v1/stats", token=None), WAIT_S)
        assert first.status == 401
        guessing = [
            asyncio.create_task(api.get("/api/v1/stats", token="fxa_" + "0" * 43)),
            asyncio.create_task(api.get("/api/v1/stats", token=None)),
        ]
        for _ in range(3):  # the pool's one connection is free for them
            ok = await asyncio.wait_for(api.get("/api/v1/stats", token="acme"), WAIT_S)
            assert ok.status == 200, ok.text
        for task in guessing:
            assert await _still_waiting(task)


async def test_a_wrong_token_at_the_sign_in_form_waits_its_turn(database_url: str) -> None:
    async with serving(database_url, pool_max=1, failed_auth_per_s=0.001) as api:
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as browser:

            async def sign_in(token: str) -> int:
                async with browser.get(api.url + "/login") as resp:
                    nonce = re.search(r'name="nonce" value="([^"]+)"', await resp.text())
                assert nonce is not None
                form = {"token": token, "nonce": nonce.group(1)}
                async with browser.post(
                    api.url + "/login", data=form, allow_redirects=False
                ) as resp:
                    return resp.status

            assert await asyncio.wait_for(sign_in("fxa_wrong"), WAIT_S) == 401
            guessing = asyncio.create_task(sign_in("fxa_wrong_again"))
            ok = await asyncio.wait_for(api.get("/api/v1/endpoints"), WAIT_S)
            assert ok.status == 200, ok.text
            assert await _still_waiting(guessing)


async def test_a_flood_of_failed_authentications_never_books_turns_minutes_away() -> None:
    """Clients that do not wait for their 401 book turns too: past a queue of two seconds
    (or two turns) a failure is answered at once, so a later one's turn is never far."""
    from fluxora_webhooks.api.deps import FailureThrottle

    throttle = FailureThrottle(20.0)
    waiting = [asyncio.create_task(throttle.wait()) for _ in range(2_000)]
    await asyncio.sleep(0)
    booked = throttle._next - time.monotonic()
    for task in waiting:
        task.cancel()
    assert booked <= 2.0 + 2 / 20.0, booked
