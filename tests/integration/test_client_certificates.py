"""Endpoints' own TLS client certificates (docs/security.md, "TLS to consumers"): over a
real `run`, each endpoint presents its own certificate to a consumer that asks for one,
several endpoints on one origin each theirs, over reused keep-alive connections too, and an
endpoint without one the deployment's (WEBHOOK_TLS_CLIENT_CERT) or none; the key is stored
sealed with WEBHOOK_ENCRYPTION_KEY and never shown or logged; a certificate that cannot be
used is refused by the API and the CLI naming the field, and a row SQL wrote with one
dead-letters its deliveries naming why."""

from __future__ import annotations

import datetime
import json
import logging
import re
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from fluxora_webhooks import endpoints
from fluxora_webhooks.secretbox import keyring_from_env, new_key
from tests.support.api import LOOPBACK, Api
from tests.support.dispatch import make_settings, rows, running_dispatcher, wait_until
from tests.support.procs import command_env, dispatcher_env, run_command, start_dispatcher
from tests.support.receiver import Receiver
from tests.support.tls_consumer import TlsConsumer, ca_file

pytestmark = pytest.mark.integration

TENANT = "bank"
URL = "https://hooks.example.com/hook"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def client_ca() -> trustme.CA:
    """The consumer's own CA, which issues the certificates it accepts from clients."""
    return trustme.CA()


def _pem(cert: trustme.LeafCert) -> tuple[str, str]:
    return cert.cert_chain_pems[0].bytes().decode(), cert.private_key_pem.bytes().decode()


def _fingerprint(cert: trustme.LeafCert) -> str:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    loaded = x509.load_pem_x509_certificate(cert.cert_chain_pems[0].bytes())
    return bytes(loaded.fingerprint(hashes.SHA256())).hex()


def _names(cert: trustme.LeafCert) -> tuple[str, str]:
    from cryptography import x509

    loaded = x509.load_pem_x509_certificate(cert.cert_chain_pems[0].bytes())
    return loaded.subject.rfc4514_string(), loaded.issuer.rfc4514_string()


def _key_body(key_pem: str) -> str:
    """The key's base64 lines, joined: what no stored, shown or logged text may hold."""
    return "".join(line for line in key_pem.splitlines() if "-----" not in line)


def _encrypted(key_pem: str) -> str:
    private = serialization.load_pem_private_key(key_pem.encode(), None)
    return private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"a passphrase"),
    ).decode()


async def _create(database_url: str, url: str, cert: trustme.LeafCert | None, keys: Any) -> str:
    client_cert = None if cert is None else endpoints.ClientCert(*_pem(cert))
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        endpoint, _ = await endpoints.create(
            conn,
            url=url,
            tenant=TENANT,
            allowed_networks=LOOPBACK,
            keys=keys,
            client_cert=client_cert,
        )
    return endpoint.id


async def _enqueue(database_url: str, n: int) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            " SELECT %s, 's' || g, 'payment.settled', jsonb_build_object('n', g)"
            " FROM generate_series(1, %s) g",
            (TENANT, n),
        )


async def _none_pending(database_url: str) -> bool:
    left = await rows(database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed")
    return left == [(0,)]


async def _deliver_in_rounds(
    database_url: str, env: dict[str, str], log: Path, rounds: int, per_round: int
) -> str:
    """A real `run` delivering ``rounds`` batches of events one after the other (the
    connections of one are reused by the next); its log. No built-in endpoint."""
    env = {k: v for k, v in env.items() if k not in ("WEBHOOK_URL", "WEBHOOK_SECRET")}
    proc = await start_dispatcher(env, log)

    async def done() -> bool:
        assert proc.proc.returncode is None, proc.log()
        return await _none_pending(database_url)

    try:
        for _ in range(rounds):
            await _enqueue(database_url, per_round)
            await wait_until(done, 30, "every event delivered")
    finally:
        proc.terminate()
        assert await proc.wait(30) == 0, proc.log()
    return proc.log()


def _peers_by_path(consumer: TlsConsumer) -> dict[str, set[str | None]]:
    found: dict[str, set[str | None]] = {}
    for request in consumer.requests:
        found.setdefault(request.target, set()).add(request.peer)
    return found


async def test_endpoints_on_one_origin_each_present_their_own_certificate(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    ca: trustme.CA,
    client_ca: trustme.CA,
    tmp_path: Path,
) -> None:
    """A and B (a certificate each) and C (none: the deployment's, WEBHOOK_TLS_CLIENT_CERT)
    on the same origin of a consumer that requires a client certificate: every request
    carries its own endpoint's, over keep-alive connections reused across batches, and
    never a connection made with another's."""
    cert_a = client_ca.issue_cert("bank-customer-a.example")
    cert_b = client_ca.issue_cert("bank-customer-b.example")
    deployment = client_ca.issue_cert("fluxora-dispatcher.example")
    both = tmp_path / "deployment.pem"
    deployment.private_key_and_cert_chain_pem.write_to_path(str(both))
    key = new_key()
    keys = keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": key})
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    with TlsConsumer(leaf, mode="mtls", client_ca=client_ca) as consumer:
        ids = {
            path: await _create(database_url, consumer.url("localhost", path), cert, keys)
            for path, cert in (("/a", cert_a), ("/b", cert_b), ("/c", None))
        }
        env = dispatcher_env(
            database_url, redis_url, "", redis_prefix,
            SSL_CERT_FILE=str(ca_file(ca, tmp_path)), WEBHOOK_POLL_INTERVAL_MS="200",
            WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8", WEBHOOK_ENCRYPTION_KEY=key,
            WEBHOOK_TLS_CLIENT_CERT=str(both),
        )  # fmt: skip
        log = await _deliver_in_rounds(database_url, env, tmp_path / "run.log", 4, 5)
        assert consumer.handshake_errors == []
    outcomes = await rows(database_url, "SELECT outcome, count(*) FROM webhook_outbox GROUP BY 1")
    assert dict(outcomes) == {"routed": 20, "delivered": 60}, log
    assert _peers_by_path(consumer) == {
        "/a": {_fingerprint(cert_a)},
        "/b": {_fingerprint(cert_b)},
        "/c": {_fingerprint(deployment)},
    }
    # Keep-alive: connections served several requests, each of one certificate only.
    by_connection: dict[int, set[str | None]] = {}
    for request in consumer.requests:
        by_connection.setdefault(request.connection, set()).add(request.peer)
    assert len(consumer.requests) == 60 and consumer.accepted < 60
    assert all(len(peers) == 1 for peers in by_connection.values()), by_connection
    # The keys: sealed in the table, bound to their endpoints, never in the log.
    for path, cert in (("/a", cert_a), ("/b", cert_b)):
        ((stored, whole),) = await rows(
            database_url,
            "SELECT client_key, row_to_json(e)::text FROM webhook_endpoints e WHERE id = %s",
            (ids[path],),
        )
        assert stored.startswith(f"fxenc:v1:{keys.current.id}:"), stored[:20]  # type: ignore[union-attr]
        assert _key_body(_pem(cert)[1]) not in whole
        assert keys.open(stored, ids[path]) == _pem(cert)[1]
        assert _key_body(_pem(cert)[1])[:40] not in log


async def test_without_a_deployment_certificate_an_endpoint_without_one_presents_none(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    ca: trustme.CA,
    client_ca: trustme.CA,
    tmp_path: Path,
) -> None:
    """A consumer that asks for a client certificate without requiring one: the endpoint
    with a certificate presents it (stored in plain text, no WEBHOOK_ENCRYPTION_KEY), the
    one on the same origin without presents none, even after the first's connections."""
    cert_a = client_ca.issue_cert("bank-customer-a.example")
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    with TlsConsumer(leaf, client_ca=client_ca) as consumer:
        plain = keyring_from_env({})
        ids = {
            path: await _create(database_url, consumer.url("localhost", path), cert, plain)
            for path, cert in (("/a", cert_a), ("/none", None))
        }
        env = dispatcher_env(
            database_url, redis_url, "", redis_prefix,
            SSL_CERT_FILE=str(ca_file(ca, tmp_path)), WEBHOOK_POLL_INTERVAL_MS="200",
            WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
        )  # fmt: skip
        await _deliver_in_rounds(database_url, env, tmp_path / "run.log", 3, 4)
    assert _peers_by_path(consumer) == {"/a": {_fingerprint(cert_a)}, "/none": {None}}
    ((stored,),) = await rows(
        database_url, "SELECT client_key FROM webhook_endpoints WHERE id = %s", (ids["/a"],)
    )
    assert stored == _pem(cert_a)[1]  # no key configured: as given, as secrets are


async def test_the_api_takes_shows_replaces_and_removes_a_certificate_never_its_key(
    api: Api, client_ca: trustme.CA, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    cert_a = client_ca.issue_cert("bank-customer-a.example")
    cert_b = client_ca.issue_cert("bank-customer-b.example")
    chain_a, key_a = _pem(cert_a)
    chain_b, key_b = _pem(cert_b)
    created = await api.post(
        "/api/v1/endpoints",
        json={"url": URL, "client_certificate": {"certificate": chain_a, "private_key": key_a}},
        token="acme",
    )
    assert created.status == 201, created.text
    shown = created.body["client_certificate"]
    assert shown["fingerprint_sha256"] == _fingerprint(cert_a)
    assert (shown["subject"], shown["issuer"]) == _names(cert_a)
    assert shown["not_after"] == "3000-01-01T00:00:00+00:00"  # trustme's
    endpoint_id = created.body["id"]
    path = f"/api/v1/endpoints/{endpoint_id}/client-certificate"
    replaced = await api.call(
        "PUT", path, json={"certificate": chain_b, "private_key": key_b}, token="acme"
    )
    assert replaced.status == 200, replaced.text
    assert replaced.body["client_certificate"]["fingerprint_sha256"] == _fingerprint(cert_b)
    got = await api.get(f"/api/v1/endpoints/{endpoint_id}", token="acme")
    assert got.body["client_certificate"] == replaced.body["client_certificate"]
    listed = await api.all_pages("/api/v1/endpoints", token="acme")
    assert [e["client_certificate"] for e in listed] == [replaced.body["client_certificate"]]
    page = await _dashboard_page(api, f"/endpoints/{endpoint_id}")
    assert _fingerprint(cert_b) in page and _key_body(key_b)[:40] not in page
    # Another tenant's token does not find it.
    assert (await api.call("PUT", path, json={"certificate": chain_a, "private_key": key_a},
                           token="bolt")).status == 404  # fmt: skip
    removed = await api.call("DELETE", path, token="acme")
    assert removed.status == 204, removed.text
    got = await api.get(f"/api/v1/endpoints/{endpoint_id}", token="acme")
    assert got.body["client_certificate"] is None
    # Removing it again changes nothing: 204, and the audit does not say it was removed.
    again = await api.call("DELETE", path, token="acme")
    assert again.status == 204, again.text
    removals = f"client certificate of endpoint {endpoint_id} removed"
    assert caplog.text.count(removals) == 1, caplog.text
    for key in (key_a, key_b):
        assert not any(_key_body(key)[:40] in text for text in api.seen)
        assert _key_body(key)[:40] not in caplog.text
    # The audit says which certificate by its fingerprint, as it is created and replaced.
    assert f"client certificate of endpoint {endpoint_id} set (sha256 {_fingerprint(cert_b)})" in (
        caplog.text
    )
    assert f"(client certificate sha256 {_fingerprint(cert_a)})" in caplog.text


async def _dashboard_page(api: Api, path: str) -> str:
    """``path`` of the dashboard, signed in with the acme token."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        async with session.get(api.url + "/login") as resp:
            nonce = re.search(r'name="nonce" value="([^"]+)"', await resp.text())
        assert nonce is not None
        form = {"token": api.tokens["acme"], "nonce": nonce.group(1)}
        async with session.post(api.url + "/login", data=form, allow_redirects=False) as resp:
            assert resp.status == 303, await resp.text()
        async with session.get(api.url + path) as resp:
            assert resp.status == 200
            return await resp.text()


async def test_the_api_refuses_a_certificate_it_cannot_use_naming_the_field(
    api: Api, client_ca: trustme.CA
) -> None:
    chain_a, key_a = _pem(client_ca.issue_cert("a.example"))
    _, key_b = _pem(client_ca.issue_cert("b.example"))
    expired = client_ca.issue_cert(
        "old.example", not_after=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    )
    cases = [
        ({"certificate": "not a certificate", "private_key": key_a}, "certificate", "PEM"),
        ({"certificate": chain_a, "private_key": "-----BEGIN PRIVATE KEY-----\nAAAA\n"
          "-----END PRIVATE KEY-----\n"}, "private_key", "not a PEM private key"),
        ({"certificate": chain_a, "private_key": key_b}, "private_key", "not the certificate's"),
        ({"certificate": chain_a, "private_key": _encrypted(key_a)}, "private_key", "encrypted"),
        (dict(zip(("certificate", "private_key"), _pem(expired), strict=True)), "certificate",
         "expired"),
    ]  # fmt: skip
    created = await api.post("/api/v1/endpoints", json={"url": URL}, token="acme")
    path = f"/api/v1/endpoints/{created.body['id']}/client-certificate"
    for body, field, words in cases:
        await _refused(api, path, body, field, words)
        post = await api.post(
            "/api/v1/endpoints", json={"url": URL, "client_certificate": body}, token="acme"
        )
        assert post.status == 422, post.text
        assert post.body["error"]["message"].startswith(f"client_certificate.{field}: ")
    assert await rows(api.database_url, "SELECT count(*) FROM webhook_endpoints") == [(1,)]
    assert await rows(
        api.database_url, "SELECT count(*) FROM webhook_endpoints WHERE client_cert IS NOT NULL"
    ) == [(0,)]
    for key in (key_a, key_b):
        assert not any(_key_body(key)[:40] in text for text in api.seen)


async def test_the_cli_reads_pem_files_and_refuses_what_it_cannot_use(
    database_url: str, client_ca: trustme.CA, tmp_path: Path
) -> None:
    cert_a = client_ca.issue_cert("a.example")
    other = client_ca.issue_cert("b.example")
    expired = client_ca.issue_cert(
        "old.example", not_after=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    )
    files = {}
    for name, text in (
        ("a.crt", _pem(cert_a)[0]),
        ("a.key", _pem(cert_a)[1]),
        ("both.pem", cert_a.private_key_and_cert_chain_pem.bytes().decode()),
        ("b.key", _pem(other)[1]),
        ("locked.key", _encrypted(_pem(cert_a)[1])),
        ("old.crt", _pem(expired)[0]),
        ("old.key", _pem(expired)[1]),
        ("junk.crt", "hello\n"),
    ):
        files[name] = tmp_path / name
        files[name].write_text(text)
    key = new_key()
    env = command_env(
        DATABASE_URL=database_url, WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
        WEBHOOK_ENCRYPTION_KEY=key,
    )  # fmt: skip
    add = ("endpoints", "add", "--url", URL, "--tenant", TENANT, "--json")
    refused = [
        (("--client-cert", files["a.crt"], "--client-key", files["b.key"]), "--client-key",
         "not the certificate's"),
        (("--client-cert", files["a.crt"], "--client-key", files["locked.key"]), "--client-key",
         "encrypted"),
        (("--client-cert", files["old.crt"], "--client-key", files["old.key"]), "--client-cert",
         "expired"),
        (("--client-cert", files["junk.crt"], "--client-key", files["a.key"]), "--client-cert",
         "not a PEM certificate"),
        (("--client-cert", files["a.crt"]), "--client-key", "holds no private key"),
        # Not a certificate at all, no --client-key: the certificate is what is wrong.
        (("--client-cert", files["junk.crt"]), "--client-cert", "holds no PEM certificate"),
        (("--client-cert", tmp_path / "none.crt", "--client-key", files["a.key"]),
         "--client-cert", "cannot read"),
    ]  # fmt: skip
    for options, option, words in refused:
        code, out = await run_command(*add, *map(str, options), env=env)
        assert code == 2, out
        assert f"error: {option}: " in out and words in out, out
    assert await rows(database_url, "SELECT count(*) FROM webhook_endpoints") == [(0,)]
    # The key in its own file, or after the certificate in one file.
    code, out = await run_command(
        *add, "--client-cert", str(files["a.crt"]), "--client-key", str(files["a.key"]), env=env
    )
    assert code == 0, out
    made = json.loads(out)
    assert made["client_certificate"]["fingerprint_sha256"] == _fingerprint(cert_a)
    code, out = await run_command(*add, "--client-cert", str(files["both.pem"]), env=env)
    assert code == 0, out
    second = json.loads(out)["id"]
    assert json.loads(out)["client_certificate"] == made["client_certificate"]
    # As a person reads it: one line, aligned with the other fields.
    code, out = await run_command("endpoints", "show", second, env=env)
    assert code == 0, out
    lines = [line for line in out.splitlines() if " " in line.strip()]
    shown = dict(line.split(None, 1) for line in lines)
    described = made["client_certificate"]
    assert shown["client_certificate"] == (
        f"{described['subject']}, issued by {described['issuer']}, valid until"
        f" {described['not_after']}, sha256 {_fingerprint(cert_a)}"
    )
    starts = {len(line) - len(line.split(None, 1)[1]) for line in lines}
    assert len(starts) == 1, out  # every value begins in one column
    # Replaced (refused first, changing nothing), then removed.
    code, out = await run_command(
        "endpoints", "update", second, "--client-cert", str(files["a.crt"]),
        "--client-key", str(files["b.key"]), "--description", "x", env=env,
    )  # fmt: skip
    assert code == 2 and "--client-key" in out, out
    assert await rows(
        database_url, "SELECT description FROM webhook_endpoints WHERE id = %s", (second,)
    ) == [("",)]
    code, out = await run_command("endpoints", "update", second, "--no-client-cert", "--json",
                                  env=env)  # fmt: skip
    assert code == 0 and json.loads(out)["client_certificate"] is None, out
    stored = await rows(database_url, "SELECT id, client_key FROM webhook_endpoints ORDER BY id")
    assert {i: k is not None and k.startswith("fxenc:v1:") for i, k in stored} == {
        made["id"]: True,
        second: False,
    }
    outputs = []
    for listing in (("endpoints", "list"), ("endpoints", "list", "--json"),
                    ("endpoints", "show", made["id"])):  # fmt: skip
        code, out = await run_command(*listing, env=env)
        assert code == 0, out
        outputs.append(out)
    assert not any(_key_body(_pem(cert_a)[1])[:40] in out for out in outputs)


async def test_secrets_decrypt_and_encrypt_cover_the_certificates_keys(
    database_url: str, client_ca: trustme.CA
) -> None:
    cert_a = client_ca.issue_cert("a.example")
    keys = keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": new_key()})
    endpoint_id = await _create(database_url, "https://hooks.example.com/a", cert_a, keys)
    query = "SELECT client_key FROM webhook_endpoints WHERE id = %s"
    ((sealed,),) = await rows(database_url, query, (endpoint_id,))
    assert sealed.startswith("fxenc:v1:")
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        done = await endpoints.reseal_secrets(conn, keys, plain=True)
        assert done.changed == 2  # its signing secret and its certificate's key
        assert await rows(database_url, query, (endpoint_id,)) == [(_pem(cert_a)[1],)]
        done = await endpoints.reseal_secrets(conn, keys)
        assert done.changed == 2
    ((again,),) = await rows(database_url, query, (endpoint_id,))
    assert again.startswith("fxenc:v1:") and keys.open(again, endpoint_id) == _pem(cert_a)[1]


async def test_a_certificate_sql_wrote_that_cannot_be_loaded_dead_letters_naming_why(
    database_url: str, receiver: Receiver, client_ca: trustme.CA
) -> None:
    """Past the checks of the CLI and the API: the endpoint is unusable as any row that
    cannot be used is (invalid_request, naming why, no attempt made); fixed, it is sent to."""
    chain_a, key_a = _pem(client_ca.issue_cert("a.example"))
    _, key_b = _pem(client_ca.issue_cert("b.example"))
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for endpoint_id, tenant, chain, key in (
            ("ep_mismatch", "t1", chain_a, key_b),
            ("ep_junk", "t2", "not a certificate", key_a),
        ):
            await conn.execute(
                "INSERT INTO webhook_endpoints (id, tenant, url, secret, client_cert, client_key)"
                " VALUES (%s, %s, %s, 'a-secret-written-by-sql-0123456789', %s, %s)",
                (endpoint_id, tenant, receiver.url, chain, key),
            )
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            " VALUES ('t1', 's', 'e', '{}'), ('t2', 's', 'e', '{}')"
        )
    settings = make_settings("", allowed_networks=LOOPBACK)
    async with running_dispatcher(settings, database_url):
        await wait_until(lambda: _none_pending(database_url), what="both dead-lettered")
        dead = dict(
            await rows(
                database_url,
                "SELECT o.endpoint_id, d.reason || ': ' || d.last_error || ' ' || d.attempts"
                " FROM webhook_dead_letter d JOIN webhook_outbox o USING (delivery_id)"
                " WHERE o.outcome = 'dead_letter'",
            )
        )
        assert dead == {
            "ep_mismatch": "invalid_request: endpoint ep_mismatch cannot be used: its client"
            " certificate's private key is not the certificate's 0",
            "ep_junk": "invalid_request: endpoint ep_junk cannot be used: its client"
            " certificate is not a PEM certificate chain (-----BEGIN CERTIFICATE----- ...) 0",
        }, dead
        assert receiver.received == []


async def test_a_certificate_key_no_key_here_opens_holds_its_deliveries(
    database_url: str,
    receiver: Receiver,
    client_ca: trustme.CA,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its key sealed with a key this dispatcher lacks: the deliveries wait, as those of a
    sealed signing secret do (never dead-lettered), and the log names the key it needs."""
    caplog.set_level(logging.ERROR, logger="fluxora_webhooks")
    chain, key = _pem(client_ca.issue_cert("a.example"))
    right = keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": new_key()})
    assert right.current is not None
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_endpoints (id, tenant, url, secret, client_cert, client_key)"
            " VALUES ('ep_sealed', 't', %s, 'a-secret-written-by-sql-0123456789', %s, %s)",
            (receiver.url, chain, right.seal(key, "ep_sealed")),
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
            " VALUES ('t', 's', 'e', '{}')"
        )

    async def held() -> bool:
        waiting = await rows(
            database_url,
            "SELECT count(*) FROM webhook_outbox WHERE endpoint_id = 'ep_sealed'"
            " AND NOT processed AND created_at > now()",
        )
        return waiting == [(1,)]

    wrong = keyring_from_env({"WEBHOOK_ENCRYPTION_KEY": new_key()})
    settings = make_settings("", allowed_networks=LOOPBACK, encryption_keys=wrong)
    async with running_dispatcher(settings, database_url):
        await wait_until(held, what="the delivery deferred")
    assert await rows(database_url, "SELECT count(*) FROM webhook_dead_letter") == [(0,)]
    said = [r.getMessage() for r in caplog.records if "ep_sealed" in r.getMessage()]
    assert said and all(
        f"client certificate's private key is encrypted with key {right.current.id}" in text
        for text in said
    ), said
    assert receiver.received == []


def _self_signed(private: Any, *, usages: list[Any] | None = None) -> tuple[str, str]:
    """A certificate of ``private``'s key (and its PEM key), with those extended usages."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "odd.example")])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
    )
    if usages is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    cert = builder.sign(private, hashes.SHA256())
    key = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key.decode()


async def test_the_api_refuses_certificates_tls_clients_cannot_present_naming_the_field(
    api: Api, client_ca: trustme.CA
) -> None:
    """What would fail every handshake, cost the API seconds of CPU or not be storable is
    refused as it is set (422 naming the field, never a 500, never the key)."""
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID

    chain_a, key_a = _pem(client_ca.issue_cert("a.example"))
    leaf = client_ca.create_child_ca().issue_cert("c.example")
    leaf_pem, intermediate_pem = (pem.bytes().decode() for pem in leaf.cert_chain_pems)
    keys = []

    def made(*pair: str) -> dict[str, str]:
        keys.append(pair[1])
        return {"certificate": pair[0], "private_key": pair[1]}

    cases = [
        (made(*_self_signed(rsa.generate_private_key(65537, 1024))), "certificate",
         "1024-bit RSA key"),
        (made(*_self_signed(ec.generate_private_key(ec.SECP256K1()))), "certificate",
         "secp256k1"),
        (made(*_self_signed(ec.generate_private_key(ec.SECP256R1()),
                            usages=[ExtendedKeyUsageOID.SERVER_AUTH])), "certificate",
         "clientAuth"),
        ({"certificate": chain_a + "\x00", "private_key": key_a}, "certificate", "NUL"),
        ({"certificate": chain_a, "private_key": key_a + "\x00"}, "private_key", "NUL"),
        ({"certificate": chain_a * 11, "private_key": key_a}, "certificate", "11 certificates"),
        ({"certificate": intermediate_pem + leaf_pem,
          "private_key": leaf.private_key_pem.bytes().decode()}, "certificate", "wrong order"),
    ]  # fmt: skip
    created = await api.post("/api/v1/endpoints", json={"url": URL}, token="acme")
    path = f"/api/v1/endpoints/{created.body['id']}/client-certificate"
    for body, field, words in cases:
        await _refused(api, path, body, field, words)
    assert await rows(
        api.database_url, "SELECT count(*) FROM webhook_endpoints WHERE client_cert IS NOT NULL"
    ) == [(0,)]
    for key in [key_a, *keys]:
        assert not any(_key_body(key)[:40] in text for text in api.seen)
    # A key of a size and kind TLS takes is still taken: P-256, in the right order.
    good = await api.call(
        "PUT",
        path,
        json=made(*_self_signed(ec.generate_private_key(ec.SECP256R1()))),
        token="acme",
    )
    assert good.status == 200, good.text


async def _refused(api: Api, path: str, body: dict[str, str], field: str, words: str) -> None:
    """A PUT of ``body`` answered 422, its message naming ``field`` and saying ``words``."""
    put = await api.call("PUT", path, json=body, token="acme")
    assert (put.status, put.error_code) == (422, "validation_error"), put.text
    assert put.body["error"]["message"].startswith(f"{field}: "), put.text
    assert words in put.body["error"]["message"], put.text


@pytest.mark.parametrize("validity", ["expired", "not_yet_valid"])
async def test_an_attempt_refused_for_a_certificate_out_of_its_validity_says_so(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    ca: trustme.CA,
    client_ca: trustme.CA,
    tmp_path: Path,
    validity: str,
) -> None:
    """A certificate set while valid expires (written here by SQL: the API and the CLI
    refuse an expired one), or one set ahead of its validity (a renewal given early): the
    consumer ends the handshake with an alert, which reads as a connection closed or
    reset; the attempt's error names the expiry or the start of validity."""
    utc = datetime.UTC
    if validity == "expired":
        given = client_ca.issue_cert(
            "bank-customer.example", not_after=datetime.datetime(2020, 1, 1, tzinfo=utc)
        )
        said = "(its client certificate expired on 2020-01-01T00:00:00+00:00)"
    else:
        given = client_ca.issue_cert(
            "bank-customer.example",
            not_before=datetime.datetime(2999, 1, 1, tzinfo=utc),
            not_after=datetime.datetime(3000, 1, 1, tzinfo=utc),
        )
        said = "(its client certificate is not valid before 2999-01-01T00:00:00+00:00)"
    chain, key = _pem(given)
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    with TlsConsumer(leaf, mode="mtls", client_ca=client_ca) as consumer:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(
                "INSERT INTO webhook_endpoints (id, tenant, url, secret, client_cert, client_key)"
                " VALUES ('ep_out', %s, %s, 'a-secret-written-by-sql-0123456789', %s, %s)",
                (TENANT, consumer.url("localhost", "/hook"), chain, key),
            )
        env = dispatcher_env(
            database_url, redis_url, "", redis_prefix,
            SSL_CERT_FILE=str(ca_file(ca, tmp_path)), WEBHOOK_POLL_INTERVAL_MS="200",
            WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8", WEBHOOK_MAX_ATTEMPTS="1",
        )  # fmt: skip
        await _deliver_in_rounds(database_url, env, tmp_path / "run.log", 1, 1)
        assert consumer.requests == []
    ((error,),) = await rows(
        database_url, "SELECT last_error FROM webhook_dead_letter WHERE endpoint_id = 'ep_out'"
    )
    assert error.endswith(said), error
