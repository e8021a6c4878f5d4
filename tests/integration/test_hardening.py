"""Issue 18, the outside QA pass, against the real engines: a loopback consumer answering
hostile headers and echoing its URL, PostgreSQL's interval limits, Redis's breaker."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import psycopg
import pytest
from aiohttp import web
from redis.asyncio import Redis

from fluxora_webhooks import deadletters
from fluxora_webhooks.connector import AddressRefused, SafeResolver
from fluxora_webhooks.gate import ALLOW
from fluxora_webhooks.httpclient import HttpClient
from fluxora_webhooks.outbox import enqueue
from fluxora_webhooks.redis_gate import RedisGate, read_breaker_state
from fluxora_webhooks.retry import RETRY_AFTER_CAP_MS, RetryPolicy
from fluxora_webhooks.settings import Settings
from tests.support.dispatch import SECRET, make_settings, pending, rows, running_dispatcher
from tests.support.dispatch import wait_until as wait_for
from tests.support.gates import make_gate, server_ms
from tests.support.receiver import Received, Receiver
from tests.support.resolvers import FixedResolver

pytestmark = pytest.mark.integration

FAST = RetryPolicy(max_attempts=3, schedule_ms=(30,), jitter=lambda: 0.0)
FULL_WIDTH_LOCALHOST = "\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54"


async def _enqueue(database_url: str) -> str:
    async with await psycopg.AsyncConnection.connect(database_url) as conn, conn.transaction():
        return await enqueue(conn, stream_id="s-1", event_type="stream.updated", payload={})


async def _idle(database_url: str) -> bool:
    return await pending(database_url) == 0


# --- 1. A malformed Retry-After never changes the outcome --------------------------------------


@pytest.mark.parametrize(("status", "retry_after"), [(503, "\u00b2"), (429, "\u2460")])
async def test_a_malformed_retry_after_is_ignored_and_the_status_kept(
    database_url: str, receiver: Receiver, status: int, retry_after: str
) -> None:
    answers = iter([web.Response(status=status, headers={"Retry-After": retry_after})])
    receiver.respond = lambda r: next(answers, web.Response(status=200))
    delivery_id = await _enqueue(database_url)
    async with running_dispatcher(make_settings(receiver.url), database_url, policy=FAST):
        await receiver.wait_for(2)
        await wait_for(lambda: _idle(database_url), what="idle")
    assert await deadletters.list_dead(database_url) == []
    history = await rows(
        database_url,
        "SELECT attempt, outcome, status_code FROM webhook_outbox"
        " WHERE delivery_id = %s ORDER BY attempt",
        (delivery_id,),
    )
    assert history == [(1, "retry", status), (2, "delivered", 200)]


async def test_a_retry_after_of_thousands_of_digits_is_the_cap(
    database_url: str, receiver: Receiver
) -> None:
    receiver.respond = lambda r: web.Response(status=503, headers={"Retry-After": "9" * 5000})
    await _enqueue(database_url)
    async with running_dispatcher(make_settings(receiver.url), database_url, policy=FAST):
        await receiver.wait_for(1)
        await wait_for(lambda: _has_retry_row(database_url), what="the retry row", timeout=10.0)
    first = await rows(
        database_url, "SELECT outcome, status_code FROM webhook_outbox WHERE attempt = 1"
    )
    ((due_in_ms,),) = await rows(
        database_url,
        "SELECT (EXTRACT(EPOCH FROM created_at - now()) * 1000)::bigint"
        " FROM webhook_outbox WHERE attempt = 2",
    )
    assert first == [("retry", 503)]
    assert RETRY_AFTER_CAP_MS - 60_000 < due_in_ms <= RETRY_AFTER_CAP_MS


async def _has_retry_row(database_url: str) -> bool:
    found = await rows(database_url, "SELECT 1 FROM webhook_outbox WHERE attempt = 2")
    return bool(found)


# --- 6 and 2. Loopback decided from the normalised host; http requires loopback ---------------


async def test_a_full_width_localhost_url_is_delivered(
    database_url: str, receiver: Receiver
) -> None:
    url = f"http://{FULL_WIDTH_LOCALHOST}:{receiver.port}/hook?token=sekrit-query-token"
    Settings.from_env({"WEBHOOK_URL": url, "WEBHOOK_SECRET": SECRET.decode()})  # start-up
    await _enqueue(database_url)
    async with running_dispatcher(make_settings(url), database_url, policy=FAST):
        await receiver.wait_for(1)
        await wait_for(lambda: _idle(database_url), what="idle")
    assert await rows(database_url, "SELECT outcome FROM webhook_outbox") == [("delivered",)]


async def test_plain_http_is_never_sent_to_a_non_loopback_answer(receiver: Receiver) -> None:
    """The http exception means every address connected to is loopback: a 'localhost'
    that a resolver answers with a public address gets no request at all (the address is
    refused before any connection), while one that answers loopback is reached."""
    url = f"http://localhost:{receiver.port}/hook"
    for answer, reached in (("93.184.216.34", False), ("127.0.0.1", True)):
        client = HttpClient(
            SafeResolver(True, require_loopback=True, resolver=FixedResolver(answer))
        )
        try:
            if reached:
                response = await client.post(url, b"{}", {}, timeout_s=2, max_body=1024)
                assert response.status == 200
            else:
                with pytest.raises(AddressRefused) as caught:
                    await client.post(url, b"{}", {}, timeout_s=2, max_body=1024)
                assert "not a loopback address" in str(caught.value)
        finally:
            await client.close()
    assert len(receiver.received) == 1


async def test_interim_responses_are_read_past_to_the_final_one() -> None:
    """A consumer (or a proxy before it) may send 1xx interim responses, such as 100
    Continue or 103 Early Hints, before its answer; the answer is the final response, and
    the keep-alive connection serves the next request with that request's own answer."""
    requests: list[bytes] = []

    async def consumer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for n in (1, 2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            requests.append(await reader.readexactly(length))
            body = f"answer {n}".encode()
            writer.write(
                b"HTTP/1.1 100 Continue\r\n\r\n"
                b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
                + (b"HTTP/1.1 201 Created\r\n" if n == 1 else b"HTTP/1.1 503 Busy\r\n")
                + b"content-length: %d\r\n\r\n" % len(body)
                + body
            )
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(consumer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HttpClient(SafeResolver(True))
    try:
        url = f"http://127.0.0.1:{port}/hook"
        first = await client.post(url, b'{"n":1}', {}, timeout_s=5, max_body=1024)
        second = await client.post(url, b'{"n":2}', {}, timeout_s=5, max_body=1024)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
    assert (first.status, first.body, first.body_error) == (201, b"answer 1", None)
    assert "link" not in first.headers
    assert (second.status, second.body) == (503, b"answer 2")
    assert requests == [b'{"n":1}', b'{"n":2}']
    assert client.opened == 1  # the second request went on the same connection


async def test_the_timeout_holds_on_a_reused_connection_and_for_a_slow_body() -> None:
    """The request timeout covers a request sent on a kept-alive connection (the path
    every request after a connection's first takes): a consumer that answers the first
    request and then holds the second gets a TimeoutError after the timeout, not later, and
    one that sends its head in time but holds the body is answered by that head, its body
    marked unreadable. Neither connection is used again."""
    held = asyncio.Event()
    handlers: list[asyncio.Task[None]] = []

    async def consumer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            if body == b"hold":
                await held.wait()  # never answers while the test runs
            elif body == b"head only":
                writer.write(b"HTTP/1.1 202 Accepted\r\ncontent-length: 100\r\n\r\npart")
                await writer.drain()
                await held.wait()
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(consumer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HttpClient(SafeResolver(True))
    url = f"http://127.0.0.1:{port}/hook"
    try:
        assert (await client.post(url, b"quick", {}, timeout_s=5, max_body=1024)).status == 200
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.post(url, b"hold", {}, timeout_s=0.3, max_body=1024)
        assert time.monotonic() - started < 3.0  # the timeout, not the test's own limit
        assert client.opened == 1  # the held request went on the kept-alive connection
        assert (await client.post(url, b"quick", {}, timeout_s=5, max_body=1024)).status == 200
        assert client.opened == 2  # the timed-out connection was not used again
        partial = await client.post(url, b"head only", {}, timeout_s=0.3, max_body=1024)
        assert (partial.status, partial.body) == (202, b"part")
        assert partial.body_error == "response body unreadable: TimeoutError"
        assert (await client.post(url, b"quick", {}, timeout_s=5, max_body=1024)).status == 200
        assert client.opened == 3
    finally:
        held.set()
        await client.close()
        server.close()
        await server.wait_closed()
        await asyncio.gather(*handlers)  # each saw the client's close and closed its end


LENIENT_ANSWERS = {
    "a folded header line": b"HTTP/1.1 200 OK\r\nx-fold: a\r\n  b\r\ncontent-length: 2\r\n\r\nok",
    "bare LF line ends": b"HTTP/1.1 200 OK\ncontent-length: 2\n\nok",
    "a space after a chunk size": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2 \r\nok\r\n0\r\n\r\n"
    ),
}


async def _answering(answer: bytes) -> asyncio.Server:
    async def consumer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(answer)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(consumer, "127.0.0.1", 0)


@pytest.mark.parametrize("case", sorted(LENIENT_ANSWERS))
async def test_a_2xx_aiohttp_reads_is_a_2xx_here(case: str) -> None:
    """Consumers' servers are not all strict: an answer aiohttp's client reads as a 2xx
    (it parses leniently outside its debug mode) is delivered, not retried as unreadable
    until it is dead-lettered."""
    server = await _answering(LENIENT_ANSWERS[case])
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    client = HttpClient(SafeResolver(True))
    try:
        ours = await client.post(url, b"{}", {}, timeout_s=5, max_body=1024)
        async with aiohttp.ClientSession() as session, session.post(url, data=b"{}") as theirs:
            assert (theirs.status, await theirs.read()) == (200, b"ok")
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
    assert (ours.status, ours.body, ours.body_error) == (200, b"ok", None)


@pytest.mark.parametrize("shape", ["many lines", "one endless line"])
async def test_endless_trailers_end_the_answer_not_the_process(shape: str) -> None:
    """A chunked 200 followed by trailers without end (many of them, or one line that
    never ends): the trailers are read past, never kept, and past 1 MiB of them the answer
    is taken as it stands (delivered, the rest unread) and the connection closed, instead
    of filling memory (and, for one line, the parser's buffer) until the timeout."""
    written = 0

    async def consumer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n")
        if shape == "one endless line":
            writer.write(b"x-t: ")
        try:
            for n in range(2_000):  # about 170 MB if never stopped
                if shape == "many lines":
                    block = b"".join(b"x-t%d-%d: v\r\n" % (n, i) for i in range(10_000))
                else:
                    block = b"v" * 85_000
                writer.write(block)
                written += len(block)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    server = await asyncio.start_server(consumer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    client = HttpClient(SafeResolver(True))
    try:
        answer = await client.post(url, b"{}", {}, timeout_s=120, max_body=1024)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
    assert (answer.status, answer.body) == (200, b"ok")
    assert answer.body_error is not None and "trailers" in answer.body_error
    assert answer.headers == {"transfer-encoding": "chunked"}
    assert written < 20_000_000  # the client hung up soon after the bound, not at the end


async def test_a_non_ascii_event_type_is_sent_as_utf8() -> None:
    """An event type written by plain SQL may hold any character; its header goes out as
    UTF-8, as aiohttp writes it, rather than failing the request."""
    heads: list[bytes] = []

    async def consumer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(consumer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    client = HttpClient(SafeResolver(True))
    try:
        for event in ("\u6ce8\u6587.created", "caf\u00e9.cr\u00e9\u00e9"):
            answer = await client.post(
                url, b"{}", {"x-fluxora-event": event}, timeout_s=5, max_body=64
            )
            assert answer.status == 204
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
    assert b"x-fluxora-event: \xe6\xb3\xa8\xe6\x96\x87.created\r\n" in heads[0]
    assert b"x-fluxora-event: caf\xc3\xa9.cr\xc3\xa9\xc3\xa9\r\n" in heads[1]


# --- 3. A zero retention is off --------------------------------------------------------------


async def test_a_zero_retention_keeps_the_history(database_url: str) -> None:
    settings = Settings.from_env(
        {"WEBHOOK_URL": "https://h.example/", "WEBHOOK_SECRET": "x" * 30, "WEBHOOK_RETENTION": "0d"}
    )
    assert settings.retention_ms is None  # off: the service starts no retention task
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, processed, processed_at)"
            " VALUES ('s', 'e', '{}', true, now() - interval '1 hour')"
        )
    assert await rows(database_url, "SELECT count(*) FROM webhook_outbox") == [(1,)]


# --- 11. Each breaker transition is logged once, by the process that made it ---------------------

URL = "https://consumer.example/hooks/p4th-secret?token=q-secret"


async def test_each_breaker_transition_is_logged_once(
    redis_client: Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    gate: RedisGate = make_gate(
        redis_client,
        prefix,
        retry_rps=1000,
        breaker_threshold=2,
        breaker_reset_ms=100,
        probe_ttl_ms=10_000,
    )
    other = make_gate(
        redis_client,
        prefix,
        retry_rps=1000,
        breaker_threshold=2,
        breaker_reset_ms=100,
        probe_ttl_ms=10_000,
    )  # a second instance sharing the breaker: it makes no transition, so logs none
    with caplog.at_level(logging.INFO, logger="fluxora_webhooks.redis_gate"):
        for _ in range(2):
            (admission,) = await gate.admit(URL, [1])
            await gate.report(URL, [(admission, False)])
        await other.report(URL, [(ALLOW, False)])  # while open: changes nothing
        reset_at = (await read_breaker_state(redis_client, URL, prefix)).reset_at_ms
        await asyncio.sleep((reset_at - await server_ms(redis_client)) / 1000 + 0.02)
        (probe,) = await gate.admit(URL, [1])
        assert probe.probe
        (deferred,) = await other.admit(URL, [1])
        assert not deferred.allowed
        await gate.report(URL, [(probe, True)])
    messages = [r.getMessage() for r in caplog.records if "circuit breaker" in r.getMessage()]
    assert messages == [
        "circuit breaker for https://consumer.example opened (from closed): attempts are"
        " deferred until a probe",
        "circuit breaker for https://consumer.example is half-open: one probe attempt may go",
        "circuit breaker for https://consumer.example closed (from half-open): deliveries resume",
    ]
    assert not any("secret" in m for m in messages)


# --- 13. What is stored is scrubbed as what is logged --------------------------------------------


async def test_a_consumer_echoing_its_url_and_token_is_stored_scrubbed(
    database_url: str, receiver: Receiver
) -> None:
    def echo(r: Received) -> web.Response:
        return web.Response(
            status=503,
            text=f"bad token sekrit-query-token at http://127.0.0.1:{receiver.port}"
            f"/hook?token=sekrit-query-token; secret {SECRET.decode()}",
        )

    receiver.respond = echo
    delivery_id = await _enqueue(database_url)
    policy = RetryPolicy(max_attempts=2, schedule_ms=(30,), jitter=lambda: 0.0)
    async with running_dispatcher(make_settings(receiver.url), database_url, policy=policy):
        await receiver.wait_for(2)
        await wait_for(lambda: _idle(database_url), what="idle")
    stored: list[tuple[Any, ...]] = await rows(
        database_url, "SELECT response_body, error FROM webhook_outbox ORDER BY attempt"
    )
    (dead,) = await deadletters.show(database_url, delivery_id)
    texts = [t for row in stored for t in row if t] + [dead["last_response"], dead["last_error"]]
    assert len(stored) == 2 and all(texts)
    for text in texts:
        assert "sekrit-query-token" not in text, text
        assert SECRET.decode() not in text, text
    assert "bad token ***" in dead["last_response"]
    assert dead["last_status"] == 503
