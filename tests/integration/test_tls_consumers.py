"""https consumers over real TLS on loopback: a private CA trusted through SSL_CERT_FILE,
what each certificate or handshake problem is recorded as (SPEC section 4: a network
error, retried, then a dead letter, its error naming the check that failed), SNI and Host,
keep-alive and closing servers, an IPv6 literal, a handshake that never ends."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trustme
from aiohttp.abc import AbstractResolver

from fluxora_webhooks.connector import SafeResolver
from fluxora_webhooks.delivery import attempt
from fluxora_webhooks.dispatcher import Dispatcher
from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.httpclient import HttpClient
from fluxora_webhooks.retry import Kind, RetryPolicy
from fluxora_webhooks.settings import Settings, check_client_certificate
from fluxora_webhooks.signing import verify
from tests.support.dispatch import (
    SECRET,
    enqueue_many,
    make_settings,
    pending,
    rows,
    wait_until,
)
from tests.support.procs import dispatcher_env, run_command, start_dispatcher
from tests.support.resolvers import FixedResolver
from tests.support.tls_consumer import TlsConsumer, ca_file

pytestmark = pytest.mark.integration

TOKEN = "tok-0a1b2c3d4e5f-in-the-query"
TWICE = RetryPolicy(max_attempts=2, schedule_ms=(30,), jitter=lambda: 0.0)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def leaf(ca: trustme.CA) -> trustme.LeafCert:
    return ca.issue_cert("localhost", "127.0.0.1", "::1", "hooks.tls.test")


def _trusting(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


def _client(ca: trustme.CA, resolver: AbstractResolver | None = None) -> HttpClient:
    return HttpClient(SafeResolver(True, resolver=resolver), ssl_context=_trusting(ca))


@pytest.fixture
def consumer(leaf: trustme.LeafCert) -> Iterator[TlsConsumer]:
    with TlsConsumer(leaf) as running:
        yield running


async def _post(client: HttpClient, url: str) -> Any:
    return await attempt(
        client,
        url,
        b'{"a": 1}',
        {"content-type": "application/json"},
        timeout_s=2.0,
        max_response_bytes=1024,
    )


# -- a private CA, through a real `fluxora-webhooks run` -------------------------------------


async def test_run_trusts_a_private_ca_named_by_ssl_cert_file(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    ca: trustme.CA,
    consumer: TlsConsumer,
    tmp_path: Path,
) -> None:
    """The operator's way to trust a consumer's private CA: SSL_CERT_FILE (docs/security.md).
    Delivered over keep-alive connections, signed, the configured name in SNI and Host."""
    trusted = ca_file(ca, tmp_path)
    url = consumer.url("localhost", f"/hook?token={TOKEN}")
    env = dispatcher_env(
        database_url,
        redis_url,
        url,
        redis_prefix,
        SSL_CERT_FILE=str(trusted),
        WEBHOOK_POLL_INTERVAL_MS="200",
    )
    proc = await start_dispatcher(env, tmp_path / "run.log")
    try:
        for _ in range(4):  # batches apart: the connections of one are reused by the next
            await enqueue_many(database_url, 5)
            await wait_until(lambda: _none_pending(database_url), 30, "every event delivered")
    finally:
        proc.terminate()
        assert await proc.wait(30) == 0, proc.log()

    outcomes = await rows(database_url, "SELECT outcome, count(*) FROM webhook_outbox GROUP BY 1")
    assert outcomes == [("delivered", 20)], proc.log()
    assert len(consumer.requests) == 20
    for request in consumer.requests:
        verify(request.body, request.headers, SECRET, scheme="standard")
        verify(request.body, request.headers, SECRET, scheme="fluxora")
        assert request.headers["host"] == f"localhost:{consumer.port}"
        assert request.target == f"/hook?token={TOKEN}"
    assert set(consumer.sni) == {"localhost"}  # the configured name, not 127.0.0.1
    assert consumer.accepted <= 5  # at most one per request in flight, reused after
    assert TOKEN not in proc.log()


async def _none_pending(database_url: str) -> bool:
    return await pending(database_url) == 0


# -- certificate and handshake problems: retried, then dead-lettered, said plainly ----------


def _self_signed(ca: trustme.CA) -> trustme.LeafCert:
    other = trustme.CA()
    return trustme.LeafCert(other.private_key_pem.bytes(), other.cert_pem.bytes(), [])


PROBLEMS: dict[str, tuple[str, Any, tuple[str, ...]]] = {
    "self-signed": (
        "ok",
        _self_signed,
        ("TLS certificate not accepted at 127.0.0.1: self-signed certificate", "SSL_CERT_FILE"),
    ),
    "expired": (
        "ok",
        lambda ca: ca.issue_cert(
            "localhost",
            not_before=datetime.datetime(2020, 1, 1),
            not_after=datetime.datetime(2021, 1, 1),
        ),
        ("TLS certificate not accepted at 127.0.0.1: certificate has expired",),
    ),
    "wrong host": (
        "ok",
        lambda ca: ca.issue_cert("other.example"),
        ("TLS certificate not accepted at 127.0.0.1: Hostname mismatch", "'localhost'"),
    ),
    "untrusted CA": (
        "ok",
        lambda ca: trustme.CA().issue_cert("localhost"),
        (
            "TLS certificate not accepted at 127.0.0.1: unable to get local issuer",
            "SSL_CERT_FILE",
        ),
    ),
    "TLS 1.0/1.1 only": (
        "tls10",
        lambda ca: ca.issue_cert("localhost"),
        ("TLS handshake failed at 127.0.0.1: no TLS version in common",),
    ),
    "client certificate required": (
        "mtls",
        lambda ca: ca.issue_cert("localhost"),
        ("TLS handshake failed", "the consumer requires a client certificate"),
    ),
    "closed in the handshake": (
        "reset",
        lambda ca: ca.issue_cert("localhost"),
        ("TLS handshake failed at 127.0.0.1: the consumer closed the connection",),
    ),
}


@pytest.mark.parametrize("problem", list(PROBLEMS))
async def test_a_tls_problem_is_retried_then_dead_lettered_with_what_failed(
    database_url: str, ca: trustme.CA, problem: str
) -> None:
    mode, make_cert, said = PROBLEMS[problem]
    with TlsConsumer(make_cert(ca), mode=mode, client_ca=ca) as consumer:
        url = consumer.url("localhost", f"/hook?token={TOKEN}")
        await enqueue_many(database_url, 1)
        client = _client(ca)
        settings = make_settings(url)
        dispatcher = Dispatcher(settings, conninfo=database_url, policy=TWICE, client=client)
        task = asyncio.create_task(dispatcher.run())
        try:
            await wait_until(lambda: _none_pending(database_url), 15, "a dead letter")
        finally:
            dispatcher.stop()
            await asyncio.wait_for(task, 30)
            await client.close()

    history = await rows(
        database_url, "SELECT attempt, outcome, status_code, error FROM webhook_outbox ORDER BY id"
    )
    assert [(a, o, s) for a, o, s, _ in history] == [(1, "retry", None), (2, "dead_letter", None)]
    ((last_error,),) = await rows(database_url, "SELECT last_error FROM webhook_dead_letter")
    for error in (*(e for *_, e in history), last_error):
        for words in said:
            assert words in error, error
        assert TOKEN not in error and "_ssl.c" not in error
    assert consumer.requests == []  # nothing was sent to a server that was not verified


# -- which failure is said when a name has several addresses ---------------------------------


@pytest.mark.parametrize("order", [("127.0.0.1", "::1"), ("::1", "127.0.0.1")])
async def test_a_certificate_failure_is_not_hidden_by_another_address_refusing(
    ca: trustme.CA, order: tuple[str, str]
) -> None:
    """The consumer listens on 127.0.0.1 with a certificate for another name; its ::1
    refuses connections. Whatever the order, the error says it was the certificate."""
    with TlsConsumer(ca.issue_cert("other.example")) as consumer:
        client = _client(ca, FixedResolver(*order))
        result = await _post(client, consumer.url("hooks.tls.test"))
        await client.close()
    assert result.kind is Kind.RETRYABLE
    assert result.error is not None
    assert "TLS certificate not accepted at 127.0.0.1: Hostname mismatch" in result.error


# -- what is already right, kept so ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ok", "close", "ragged"])
async def test_keep_alive_and_servers_that_close(
    ca: trustme.CA, leaf: trustme.LeafCert, mode: str
) -> None:
    """A keep-alive server gets one connection for many requests; one that closes after
    each response (with close_notify or without) gets a new one each time, and nothing
    fails."""
    with TlsConsumer(leaf, mode=mode) as consumer:
        client = _client(ca)
        results = []
        for _ in range(5):
            results.append(await _post(client, consumer.url("localhost")))
            await asyncio.sleep(0.05)  # the close reaches the client before the next request
        await client.close()
    assert [r.kind for r in results] == [Kind.DELIVERED] * 5
    assert consumer.accepted == (1 if mode == "ok" else 5)
    assert client.opened == consumer.accepted
    assert set(consumer.sni) == {"localhost"}
    assert {r.headers["host"] for r in consumer.requests} == {f"localhost:{consumer.port}"}


async def test_an_ipv6_literal_url_is_delivered_without_sni(
    ca: trustme.CA, leaf: trustme.LeafCert
) -> None:
    with TlsConsumer(leaf, host="::1") as consumer:
        client = _client(ca)
        result = await _post(client, consumer.url())
        await client.close()
    assert result.kind is Kind.DELIVERED
    assert consumer.sni == [None]  # RFC 6066: no IP literal in SNI; the certificate's IP
    assert consumer.requests[0].headers["host"] == f"[::1]:{consumer.port}"


def _client_sockets(port: int) -> list[Any]:
    """This process's TCP sockets connected to ``port`` (the consumer's own accepted ones
    are on the other end)."""
    return [c for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr[1] == port]


async def test_a_handshake_never_answered_times_out_and_leaks_nothing(
    ca: trustme.CA, leaf: trustme.LeafCert
) -> None:
    with TlsConsumer(leaf, mode="hang") as consumer:
        client = _client(ca)
        tasks = len(asyncio.all_tasks())
        results = [
            await attempt(
                client, consumer.url("localhost"), b"{}", {}, timeout_s=0.2, max_response_bytes=1
            )
            for _ in range(10)
        ]
        await asyncio.sleep(0.2)
        assert _client_sockets(consumer.port) == []
        assert len(asyncio.all_tasks()) == tasks
        await client.close()
    assert {(r.kind, r.reason, r.error) for r in results} == {
        (Kind.RETRYABLE, "timeout", "timeout")
    }
    assert client.opened == 0


# -- mutual TLS: the dispatcher's client certificate -------------------------------------------


async def test_run_presents_its_client_certificate_to_a_consumer_that_requires_one(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    ca: trustme.CA,
    leaf: trustme.LeafCert,
    tmp_path: Path,
) -> None:
    """WEBHOOK_TLS_CLIENT_CERT and WEBHOOK_TLS_CLIENT_KEY (docs/security.md): a consumer that
    requires a client certificate signed by its own CA gets every delivery, over a real
    `run`; the key may be in the certificate's file or in a file of its own."""
    client_ca = trustme.CA()
    client = client_ca.issue_cert("fluxora-dispatcher.example")
    trusted = ca_file(ca, tmp_path)
    both, cert_only, key_only = (tmp_path / name for name in ("both.pem", "cert.pem", "key.pem"))
    client.private_key_and_cert_chain_pem.write_to_path(str(both))
    client.cert_chain_pems[0].write_to_path(str(cert_only))
    client.private_key_pem.write_to_path(str(key_only))
    with TlsConsumer(leaf, mode="mtls", client_ca=client_ca) as consumer:
        url = consumer.url("localhost", f"/hook?token={TOKEN}")
        for files in ({"WEBHOOK_TLS_CLIENT_CERT": str(both)},
                      {"WEBHOOK_TLS_CLIENT_CERT": str(cert_only),
                       "WEBHOOK_TLS_CLIENT_KEY": str(key_only)}):  # fmt: skip
            env = dispatcher_env(
                database_url, redis_url, url, redis_prefix,
                SSL_CERT_FILE=str(trusted), WEBHOOK_POLL_INTERVAL_MS="200", **files,
            )  # fmt: skip
            proc = await start_dispatcher(env, tmp_path / "run.log")
            try:
                await enqueue_many(database_url, 5)
                await wait_until(lambda: _none_pending(database_url), 30, "every event delivered")
            finally:
                proc.terminate()
                assert await proc.wait(30) == 0, proc.log()
        assert consumer.handshake_errors == []
    outcomes = await rows(database_url, "SELECT outcome, count(*) FROM webhook_outbox GROUP BY 1")
    assert outcomes == [("delivered", 10)]
    assert len(consumer.requests) == 10


def test_a_client_certificate_that_cannot_be_used_stops_start_up(
    ca: trustme.CA, tmp_path: Path
) -> None:
    """Each problem named with its variable, at start rather than at the first consumer
    that asks for the certificate (and an encrypted key never makes OpenSSL ask a terminal
    for its password)."""
    from cryptography.hazmat.primitives import serialization

    client, other = ca.issue_cert("one.example"), ca.issue_cert("two.example")
    cert, key, wrong, locked = (
        tmp_path / name for name in ("cert.pem", "key.pem", "wrong.pem", "locked.pem")
    )
    client.cert_chain_pems[0].write_to_path(str(cert))
    client.private_key_pem.write_to_path(str(key))
    other.private_key_pem.write_to_path(str(wrong))
    private = serialization.load_pem_private_key(client.private_key_pem.bytes(), None)
    locked.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"a passphrase"),
        )
    )
    base = {"DATABASE_URL": "postgresql://127.0.0.1/x", "REDIS_URL": "redis://127.0.0.1/0"}
    cases = [
        ({"WEBHOOK_TLS_CLIENT_KEY": str(key)}, "WEBHOOK_TLS_CLIENT_KEY", "without"),
        ({"WEBHOOK_TLS_CLIENT_CERT": str(tmp_path / "none.pem")}, "WEBHOOK_TLS_CLIENT_CERT",
         "none.pem"),
        ({"WEBHOOK_TLS_CLIENT_CERT": str(cert)}, "WEBHOOK_TLS_CLIENT_CERT", "private key"),
        ({"WEBHOOK_TLS_CLIENT_CERT": str(cert), "WEBHOOK_TLS_CLIENT_KEY": str(wrong)},
         "WEBHOOK_TLS_CLIENT_CERT", "not the certificate's"),
        ({"WEBHOOK_TLS_CLIENT_CERT": str(cert), "WEBHOOK_TLS_CLIENT_KEY": str(locked)},
         "WEBHOOK_TLS_CLIENT_KEY", "encrypted"),
    ]  # fmt: skip
    for given, variable, words in cases:
        with pytest.raises(ConfigError) as caught:
            check_client_certificate(Settings.from_env({**base, **given}))
        assert caught.value.variable == variable, (given, caught.value)
        assert words in str(caught.value), (given, caught.value)
    settings = Settings.from_env(
        {**base, "WEBHOOK_TLS_CLIENT_CERT": str(cert), "WEBHOOK_TLS_CLIENT_KEY": str(key)}
    )
    check_client_certificate(settings)
    assert (settings.tls_client_cert, settings.tls_client_key) == (str(cert), str(key))
    # Only `run` reads the files: another command sharing the environment does not.
    assert Settings.from_env({**base, "WEBHOOK_TLS_CLIENT_CERT": str(tmp_path / "none.pem")})


async def test_run_stops_on_a_client_certificate_it_cannot_read(
    database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    missing = tmp_path / "client.pem"
    for workers in ("1", "2"):
        env = dispatcher_env(
            database_url, redis_url, "http://127.0.0.1:9/hook", redis_prefix,
            WEBHOOK_TLS_CLIENT_CERT=str(missing), WEBHOOK_WORKERS=workers,
        )  # fmt: skip
        code, out = await run_command("run", env=env, timeout=60)
        assert code == 2, out
        assert "WEBHOOK_TLS_CLIENT_CERT" in out and str(missing) in out, out
