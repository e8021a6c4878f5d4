"""An egress proxy (``WEBHOOK_PROXY_URL``): https consumers reached through a real
``CONNECT`` proxy on loopback, to the address the policy checked, with the proxy's user and
password kept out of every error and log; loopback connected to directly by default
(``WEBHOOK_NO_PROXY``); what a proxy's refusal is recorded as."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trustme
from psycopg.rows import tuple_row

from fluxora_webhooks import endpoints, enqueue
from fluxora_webhooks.api.dashboard.delivery_pages import why_it_waits_or_ended
from fluxora_webhooks.commands.status import render
from fluxora_webhooks.connector import SafeResolver
from fluxora_webhooks.deliveries import get_delivery
from fluxora_webhooks.delivery import EGRESS_HELD, attempt
from fluxora_webhooks.errors import EndpointError
from fluxora_webhooks.httpclient import HttpClient
from fluxora_webhooks.ops import read_status
from fluxora_webhooks.retry import Kind
from fluxora_webhooks.settings import NO_PROXY_DEFAULT, parse_proxy_url
from fluxora_webhooks.signing import verify
from tests.support.connect_proxy import ConnectProxy
from tests.support.dispatch import SECRET, enqueue_many, pending, rows, wait_until
from tests.support.procs import dispatcher_env, free_port, run_command, start_dispatcher
from tests.support.resolvers import FixedResolver
from tests.support.tls_consumer import TlsConsumer, ca_file

pytestmark = pytest.mark.integration

PASSWORD = "pr0xy-pass-7f3a9c"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def consumer(ca: trustme.CA) -> AsyncIterator[TlsConsumer]:
    with TlsConsumer(ca.issue_cert("localhost", "127.0.0.1", "hooks.tls.test")) as running:
        yield running
    # Its connections are closed: the client's TLS transports end once they see it, while
    # this test's event loop still runs (not unclosed when the loop is).
    await asyncio.sleep(0.05)


def _client(
    ca: trustme.CA, proxy_url: str, *, no_proxy: Any = (), resolver: Any = None
) -> HttpClient:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return HttpClient(
        SafeResolver(True, resolver=resolver or FixedResolver("127.0.0.1")),
        ssl_context=ctx,
        proxy=parse_proxy_url(proxy_url),
        no_proxy=no_proxy,
    )


async def _post(client: HttpClient, url: str) -> Any:
    return await attempt(
        client, url, b'{"a": 1}', {"content-type": "application/json"},
        timeout_s=5.0, max_response_bytes=1024,
    )  # fmt: skip


async def test_https_goes_through_the_tunnel_to_the_checked_address(
    ca: trustme.CA, consumer: TlsConsumer
) -> None:
    """The tunnel names the address the policy checked (the proxy resolves nothing); the
    TLS handshake and the Host field name the consumer; one tunnel serves keep-alive."""
    async with ConnectProxy(credentials=("egress", PASSWORD)) as proxy:
        client = _client(ca, proxy.url)
        try:
            url = consumer.url("hooks.tls.test", "/hook")
            first, second = await _post(client, url), await _post(client, url)
        finally:
            await client.close()
    assert (first.kind, second.kind) == (Kind.DELIVERED, Kind.DELIVERED), first.error
    assert proxy.targets == [f"127.0.0.1:{consumer.port}"]  # one tunnel, to the address
    assert proxy.authorizations[0] is not None and proxy.authorizations[0].startswith("Basic ")
    assert consumer.sni == ["hooks.tls.test"]
    assert [r.headers["host"] for r in consumer.requests] == [f"hooks.tls.test:{consumer.port}"] * 2


@pytest.mark.parametrize(
    ("refusal", "said", "reason"),
    [
        # The proxy's failures, no fault of the consumer's: "egress" (held, see below).
        ("password", "refused CONNECT 127.0.0.1:{port}: 407 Proxy Authentication Required"
         " (the user and password of WEBHOOK_PROXY_URL)", "egress"),
        ("down", "the egress proxy cannot be reached", "egress"),
        # About this consumer: its endpoint's failure, as a direct connection's would be.
        ("forbidden", "refused CONNECT 127.0.0.1:{port}: 403 Forbidden", "connection_error"),
        ("consumer down", "refused CONNECT 127.0.0.1:{port}: 502 Bad Gateway",
         "connection_error"),
    ],
)  # fmt: skip
async def test_a_proxy_that_refuses_is_a_retryable_failure_that_says_so(
    ca: trustme.CA, consumer: TlsConsumer, refusal: str, said: str, reason: str
) -> None:
    async def post_once(proxy_url: str, port: int) -> Any:
        client = _client(ca, proxy_url)
        try:
            return await _post(client, f"https://hooks.tls.test:{port}/hook")
        finally:
            await client.close()

    port = free_port() if refusal == "consumer down" else consumer.port
    async with ConnectProxy(
        credentials=("egress", PASSWORD), refuse=refusal == "forbidden"
    ) as proxy:
        url = proxy.url.replace(PASSWORD, "wrong-0c1d") if refusal == "password" else proxy.url
        if refusal != "down":
            result = await post_once(url, port)
    if refusal == "down":
        result = await post_once(url, port)  # the proxy has stopped
    assert result.kind is Kind.RETRYABLE
    assert said.format(port=port, proxy=proxy.port) in result.error, result.error
    assert result.reason == reason
    assert PASSWORD not in result.error and "wrong-0c1d" not in result.error
    # The error is stored on the attempt, which the endpoint's tenant reads: the proxy,
    # this service's own, is not named by its address.
    assert f":{proxy.port}" not in result.error, result.error
    assert consumer.requests == []


async def test_a_proxy_that_never_answers_is_the_proxys_failure(
    ca: trustme.CA, consumer: TlsConsumer
) -> None:
    """It takes the connection and says nothing to CONNECT: the request's timeout is the
    proxy's failure (held as an egress failure), not the consumer's timeout."""
    async with ConnectProxy(answer=()) as proxy:
        client = _client(ca, proxy.url)
        try:
            result = await attempt(
                client, consumer.url("hooks.tls.test", "/hook"), b"{}", {},
                timeout_s=0.5, max_response_bytes=1024,
            )  # fmt: skip
        finally:
            await client.close()
    assert (result.kind, result.reason) == (Kind.RETRYABLE, "egress"), result
    assert "the egress proxy did not answer within the timeout" in (result.error or "")
    assert consumer.requests == []


async def test_a_consumer_that_never_answers_through_the_tunnel_is_the_consumers_timeout(
    ca: trustme.CA,
) -> None:
    """The proxy opened the tunnel; the consumer behind it takes the connection and says
    nothing: the endpoint's timeout, not the proxy's failure."""
    held: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with ConnectProxy() as proxy:
            client = _client(ca, proxy.url)
            try:
                result = await attempt(
                    client, f"https://hooks.tls.test:{port}/hook", b"{}", {},
                    timeout_s=0.5, max_response_bytes=1024,
                )  # fmt: skip
            finally:
                await client.close()
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
    assert proxy.targets == [f"127.0.0.1:{port}"]
    assert (result.kind, result.reason) == (Kind.RETRYABLE, "timeout"), result


async def test_loopback_is_connected_to_directly_by_default(
    ca: trustme.CA, consumer: TlsConsumer
) -> None:
    """A proxy elsewhere cannot reach this host's loopback: WEBHOOK_NO_PROXY's default."""
    async with ConnectProxy() as proxy:
        client = _client(ca, proxy.url, no_proxy=NO_PROXY_DEFAULT)
        try:
            result = await _post(client, consumer.url("hooks.tls.test", "/hook"))
        finally:
            await client.close()
    assert result.kind is Kind.DELIVERED, result.error
    assert proxy.targets == []


async def test_the_address_policy_still_decides_before_any_tunnel(ca: trustme.CA) -> None:
    """A name resolving to a private address is refused here; the proxy is never asked."""
    async with ConnectProxy() as proxy:
        client = HttpClient(
            SafeResolver(False, resolver=FixedResolver("10.1.2.3")),
            proxy=parse_proxy_url(proxy.url),
        )
        try:
            with pytest.raises(EndpointError, match=r"10\.1\.2\.3"):
                await client.post(
                    "https://hooks.internal.test/hook", b"{}", {}, timeout_s=5.0, max_body=10
                )
        finally:
            await client.close()
    assert proxy.targets == []


async def test_run_delivers_through_the_proxy_and_never_logs_its_password(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    ca: trustme.CA,
    consumer: TlsConsumer,
    tmp_path: Path,
) -> None:
    trusted = ca_file(ca, tmp_path)
    async with ConnectProxy(credentials=("egress", PASSWORD)) as proxy:
        env = dispatcher_env(
            database_url, redis_url, consumer.url("localhost", "/hook"), redis_prefix,
            SSL_CERT_FILE=str(trusted), WEBHOOK_POLL_INTERVAL_MS="200",
            WEBHOOK_PROXY_URL=proxy.url, WEBHOOK_NO_PROXY="none", LOG_LEVEL="DEBUG",
        )  # fmt: skip
        run = await start_dispatcher(env, tmp_path / "run.log")
        try:
            await enqueue_many(database_url, 10)

            async def delivered() -> bool:
                return await pending(database_url) == 0

            await wait_until(delivered, 30, "every event delivered")
        finally:
            run.terminate()
            assert await run.wait(30) == 0, run.log()
    outcomes = await rows(database_url, "SELECT outcome, count(*) FROM webhook_outbox GROUP BY 1")
    assert outcomes == [("delivered", 10)], run.log()
    assert proxy.targets and set(proxy.targets) == {f"127.0.0.1:{consumer.port}"}
    for request in consumer.requests:
        verify(request.body, request.headers, SECRET, scheme="standard")
    assert PASSWORD not in run.log()


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("WEBHOOK_PROXY_URL", "https://proxy.corp:3128", "must be an http:// proxy URL"),
        ("WEBHOOK_PROXY_URL", f"http://u:{PASSWORD}@proxy.corp:3128/x", "without a path"),
        ("WEBHOOK_NO_PROXY", "10.0.0.0/33", "is not a CIDR network"),
    ],
)
async def test_a_bad_proxy_setting_stops_start_up_naming_it(
    database_url: str, variable: str, value: str, said: str
) -> None:
    env = dispatcher_env(
        database_url, "redis://127.0.0.1:1/0", "https://hooks.example.com/x", "p:",
        WEBHOOK_PROXY_URL="http://proxy.corp:3128",
    )  # fmt: skip
    env[variable] = value
    code, out = await run_command("run", env=env, timeout=30)
    assert code == 2, out
    assert f"configuration error: {variable}: " in out and said in out, out
    assert PASSWORD not in out


@pytest.mark.parametrize("written", ["percent-encoded", "as bytes of the environment"])
async def test_a_password_that_is_not_utf8_is_sent_byte_for_byte(
    ca: trustme.CA, consumer: TlsConsumer, written: str
) -> None:
    """``%FF`` is the byte FF (not U+FFFD's three bytes), as curl sends it; an environment
    byte that is not UTF-8 (Python's surrogateescape) is that byte too, not a crash."""
    password = b"pr0xy-\xff\xfe-pass"
    async with ConnectProxy(credentials=("egress", password)) as proxy:
        url = proxy.url
        if written != "percent-encoded":
            url = f"http://egress:{password.decode('utf-8', 'surrogateescape')}@{proxy.shown}"
        client = _client(ca, url)
        try:
            result = await _post(client, consumer.url("hooks.tls.test", "/hook"))
        finally:
            await client.close()
    assert result.kind is Kind.DELIVERED, result.error
    assert proxy.targets == [f"127.0.0.1:{consumer.port}"]


_PAD = b"x-pad: " + b"a" * 10_000 + b"\r\n"


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        # Split anywhere, HTTP/1.0: a tunnel.
        ((b"HTTP/1.0 200 Conn", b"ection established\r\n", b"\r\n"), None),
        # Over 16 KiB in all, its end in the last read.
        ((b"HTTP/1.1 200 OK\r\n" + _PAD, _PAD + b"\r\n"), "an answer larger than 16 KiB"),
        # A superscript two is a digit to isdigit only.
        (("HTTP/1.1 \u00b200 OK\r\n\r\n".encode("latin-1"),), ": no HTTP answer"),
    ],
    ids=["split", "oversize", "not-ascii-digits"],
)
async def test_the_proxy_answer_is_read_whole_and_bounded_however_it_is_cut(
    ca: trustme.CA, consumer: TlsConsumer, answer: tuple[bytes, ...], said: str | None
) -> None:
    async with ConnectProxy(answer=answer) as proxy:
        client = _client(ca, proxy.url)
        try:
            result = await _post(client, consumer.url("hooks.tls.test", "/hook"))
        finally:
            await client.close()
    if said is None:
        assert result.kind is Kind.DELIVERED, result.error
        return
    assert result.kind is Kind.RETRYABLE
    assert "the egress proxy gave no usable answer to CONNECT" in result.error
    assert said in result.error, result.error
    assert consumer.requests == []


async def test_a_proxy_outage_holds_deliveries_and_disables_no_endpoint(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    ca: trustme.CA,
    consumer: TlsConsumer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The proxy is down for longer than WEBHOOK_DISABLE_AFTER: no consumer was asked, so
    the endpoint stays enabled with no failure streak, its breaker (opened by one failure
    here) hears nothing, and each delivery keeps its first attempt (no retry written,
    nothing dead-lettered). Once the proxy is back, the held
    deliveries go, each as attempt 1."""
    proxy = ConnectProxy(credentials=("egress", PASSWORD), port=free_port())
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, _ = await endpoints.create(
            conn, url=consumer.url("localhost", "/hook"), tenant="acme",
            allowed_networks=(ipaddress.ip_network("127.0.0.0/8"),),
        )  # fmt: skip
        for i in range(2):
            await enqueue(conn, tenant="acme", stream_id=f"s{i}", event_type="order.paid",
                          payload={"i": i})  # fmt: skip
    env = dispatcher_env(
        database_url, redis_url, "", redis_prefix,
        SSL_CERT_FILE=str(ca_file(ca, tmp_path)), WEBHOOK_POLL_INTERVAL_MS="100",
        WEBHOOK_PROXY_URL=proxy.url, WEBHOOK_NO_PROXY="none",
        WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8", WEBHOOK_DISABLE_AFTER="1s",
        WEBHOOK_RETRY_SCHEDULE="100ms", WEBHOOK_MAX_ATTEMPTS="50",
        WEBHOOK_CIRCUIT_BREAKER_THRESHOLD="1",
    )  # fmt: skip
    del env["WEBHOOK_URL"], env["WEBHOOK_SECRET"]
    run = await start_dispatcher(env, tmp_path / "run.log")
    try:

        async def tried() -> bool:  # each attempted once: recorded, or held for later
            tried = await rows(
                database_url,
                "SELECT count(DISTINCT delivery_id) FROM webhook_outbox WHERE endpoint_id = %s"
                " AND (processed OR created_at > now())",
                (endpoint.id,),
            )
            return bool(tried == [(2,)])

        await wait_until(tried, 30, "both attempted")
        await asyncio.sleep(2.5)  # past WEBHOOK_DISABLE_AFTER, many retry delays over
        state = await rows(
            database_url, "SELECT state, failing_since FROM webhook_endpoints WHERE id = %s",
            (endpoint.id,),
        )  # fmt: skip
        assert state == [("enabled", None)], run.log()
        attempts = await rows(
            database_url,
            "SELECT attempt, processed FROM webhook_outbox WHERE endpoint_id = %s",
            (endpoint.id,),
        )
        assert sorted(attempts) == [(1, False), (1, False)], run.log()
        # What a user reading a held delivery is told (the API, the dashboard's page).
        held = await _deliveries_of(database_url, endpoint.id)
        assert [d["wait_reason"] for d in held] == [EGRESS_HELD] * 2, run.log()
        assert [d["status"] for d in held] == ["pending"] * 2
        assert why_it_waits_or_ended(held[0]) == EGRESS_HELD
        assert str(proxy.port) not in EGRESS_HELD and "proxy failed" in EGRESS_HELD
        # What an operator's `status` says of them.
        assert await _status_of_held(database_url, capsys) == (2, [HELD_LINE])
        async with proxy:

            async def delivered() -> bool:
                return await pending(database_url) == 0

            await wait_until(delivered, 30, "both delivered once the proxy is back")
    finally:
        run.terminate()
        assert await run.wait(30) == 0, run.log()
    outcomes = await rows(
        database_url,
        "SELECT outcome, attempt FROM webhook_outbox WHERE endpoint_id = %s",
        (endpoint.id,),
    )
    assert outcomes == [("delivered", 1), ("delivered", 1)], run.log()
    assert await _status_of_held(database_url, capsys) == (0, [])
    done = await _deliveries_of(database_url, endpoint.id)
    assert [(d["status"], d["wait_reason"]) for d in done] == [("delivered", None)] * 2
    assert [a["error"] for d in done for a in d["attempts"]] == [None, None]
    assert [r.headers["x-fluxora-attempt"] for r in consumer.requests] == ["1", "1"]
    assert await rows(database_url, "SELECT count(*) FROM webhook_dead_letter") == [(0,)]
    assert "the egress proxy failed" in run.log()
    assert "the egress proxy works again" in run.log()
    assert "this process held are due now" in run.log()
    assert f"https through the proxy 127.0.0.1:{proxy.port})" in run.log()  # at start-up
    assert "circuit breaker" not in run.log()
    assert PASSWORD not in run.log()


async def _deliveries_of(database_url: str, endpoint_id: str) -> list[dict[str, Any]]:
    """Each delivery of the endpoint as the API and the dashboard read it."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        conn.row_factory = tuple_row
        cur = await conn.execute(
            "SELECT DISTINCT delivery_id::text FROM webhook_outbox WHERE endpoint_id = %s",
            (endpoint_id,),
        )
        ids = sorted(str(row[0]) for row in await cur.fetchall())
        return [await get_delivery(conn, delivery_id) for delivery_id in ids]


HELD_LINE = (
    "2 deliveries held: this service's way out failed (the egress proxy,"
    " WEBHOOK_PROXY_URL, or its DNS lookups), so no consumer was asked and no attempt is"
    " used; they are sent when it works again"
)


async def _status_of_held(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> tuple[int, list[str]]:
    """What `status` counts as held by the proxy (--json), and its lines that say so."""
    capsys.readouterr()
    snapshot = await read_status(
        database_url, minutes=15, webhook_url=None, redis_url=None, endpoints=0
    )
    render(snapshot)
    lines = capsys.readouterr().out.splitlines()
    return snapshot["backlog"]["egress_held"], [x for x in lines if "deliveries held" in x]
