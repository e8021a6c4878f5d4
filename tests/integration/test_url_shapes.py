"""Consumer URLs of unusual shapes, end to end: a fully qualified name with its trailing
dot over real TLS, a registered consumer on IPv6 loopback receiving signed deliveries, and
the API's and the CLI's refusals of a port of 0 and of an IPv6 zone identifier."""

from __future__ import annotations

import dataclasses
import ipaddress
import ssl

import psycopg
import pytest
import trustme

from fluxora_webhooks import endpoints, enqueue
from fluxora_webhooks.connector import SafeResolver
from fluxora_webhooks.delivery import attempt
from fluxora_webhooks.httpclient import HttpClient
from fluxora_webhooks.retry import Kind
from fluxora_webhooks.signing import verify
from tests.support.api import serving
from tests.support.dispatch import make_settings, running_dispatcher
from tests.support.procs import command_env, run_command
from tests.support.receiver import Receiver
from tests.support.resolvers import FixedResolver
from tests.support.tls_consumer import TlsConsumer

pytestmark = pytest.mark.integration

IPV6_LOOPBACK = (ipaddress.ip_network("::1/128"),)


async def test_a_trailing_dot_name_is_verified_and_sent_as_the_name_without_it() -> None:
    """``https://Hooks.TLS.test.:port/``: a fully qualified name. Its certificate and SNI
    name it without the dot (RFC 6066), as browsers and curl do; every delivery used to
    fail with a hostname mismatch."""
    ca = trustme.CA()
    with TlsConsumer(ca.issue_cert("hooks.tls.test")) as consumer:
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        client = HttpClient(
            SafeResolver(True, resolver=FixedResolver("127.0.0.1")), ssl_context=ctx
        )
        try:
            result = await attempt(
                client,
                consumer.url("Hooks.TLS.test."),
                b'{"a": 1}',
                {"content-type": "application/json"},
                timeout_s=5.0,
                max_response_bytes=1024,
            )
        finally:
            await client.close()
    assert result.kind is Kind.DELIVERED, result.error
    assert consumer.sni == ["hooks.tls.test"]
    assert consumer.requests[0].target == "/hook"


async def test_a_registered_consumer_on_ipv6_loopback_receives_signed_deliveries(
    database_url: str,
) -> None:
    receiver = Receiver(host="::1")
    await receiver.start()
    try:
        url = f"http://[::1]:{receiver.port}/hook?q=%E2%9C%93"
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            endpoint, secret = await endpoints.create(
                conn, url=url, tenant="v6", allowed_networks=IPV6_LOOPBACK
            )
            await enqueue(conn, tenant="v6", stream_id="s", event_type="t.one", payload={"a": 1})
        settings = dataclasses.replace(
            make_settings("", allowed_networks=IPV6_LOOPBACK), secret=b""
        )
        async with running_dispatcher(settings, database_url):
            await receiver.wait_for(1)
    finally:
        await receiver.stop()
    got = receiver.received[0]
    assert verify(got.body, got.headers, secret) == got.delivery_id
    assert got.headers["host"] == f"[::1]:{receiver.port}"
    assert endpoint.url == url


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("https://hooks.example.com:0/in?token=s3cr3t", "port 0"),
        ("https://[fe80::1%25eth0]/in?token=s3cr3t", "zone identifier"),
    ],
)
async def test_the_api_and_the_cli_refuse_port_0_and_a_zone_identifier(
    database_url: str, redis_url: str, prefix: str, url: str, named: str
) -> None:
    async with serving(database_url, redis_url, prefix) as api:
        created = await api.post("/api/v1/endpoints", json={"url": url, "tenant": "acme"})
        assert created.status == 422, created.text
        assert created.error_code == "validation_error"
        assert named in created.body["error"]["message"]
        assert "s3cr3t" not in created.text
    code, out = await run_command(
        "endpoints",
        "add",
        "--tenant",
        "acme",
        "--url",
        url,
        env=command_env(DATABASE_URL=database_url, REDIS_URL=redis_url),
    )
    assert code == 2 and named in out and "Traceback" not in out, out
    assert "s3cr3t" not in out
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute("SELECT count(*) FROM webhook_endpoints WHERE tenant = 'acme'")
        assert await cur.fetchone() == (0,)
