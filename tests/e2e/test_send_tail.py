"""``send`` and ``tail`` as an integrating engineer runs them (SPEC 18), against a real
service: send prints the delivery id of each endpoint the event reaches (the ones the
consumer then receives), tail's JSON lines show the attempts of events sent while it runs,
scoped by tenant and endpoint; bad input is refused naming the option."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiohttp import web

from fluxora_webhooks import endpoints
from fluxora_webhooks.cli import main
from tests.support.procs import dispatcher_env, dispatchers, run_command
from tests.support.receiver import Received, Receiver

pytestmark = pytest.mark.e2e

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


def fail_first(item: Received) -> web.Response:
    body = json.loads(item.body)
    if isinstance(body, dict) and body.get("fail_first") and item.attempt == 1:
        return web.Response(status=500, text="not yet")
    return web.Response(status=200, text="ok")


async def send(env: dict[str, str], *args: str) -> tuple[int, str]:
    return await run_command("send", *args, env=env)


@asynccontextmanager
async def tail(env: dict[str, str], *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``tail --json ...``, started and tailing when this yields."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fluxora_webhooks", "tail", "--json", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        first = await asyncio.wait_for(proc.stderr.readline(), 30)
        assert b"tailing attempts" in first, first
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def lines_of(proc: asyncio.subprocess.Process) -> list[dict[str, Any]]:
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.decode().splitlines()]


async def test_send_prints_the_delivery_ids_and_tail_shows_their_attempts_in_scope(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    receiver.respond = fail_first
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        streams, _ = await endpoints.create(
            conn, url=receiver.url, tenant="acme", event_types=["stream.*"],
            allowed_networks=LOOPBACK,
        )  # fmt: skip
        await endpoints.create(
            conn, url=receiver.url, tenant="acme", event_types=["invoice.*"],
            allowed_networks=LOOPBACK,
        )  # fmt: skip
        other, _ = await endpoints.create(
            conn, url=receiver.url, tenant="bolt", allowed_networks=LOOPBACK
        )
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8", WEBHOOK_RETRY_SCHEDULE="100ms",
        WEBHOOK_POLL_INTERVAL_MS="200",
    )  # fmt: skip
    async with (
        dispatchers(1, env, tmp_path),
        tail(env, "--tenant", "acme", "--limit", "2") as acme,
        tail(env, "--endpoint", other.id, "--limit", "1") as bolt_only,
        tail(env, "--limit", "4") as everyone,
    ):
        # bolt's event first, received before acme's is sent: a tail scoped to acme that
        # leaked other tenants would show it before acme's attempts.
        code, out = await send(env, "--tenant", "bolt", "--event", "invoice.paid",
                               "--payload", '{"n": 1}')  # fmt: skip
        assert code == 0, out
        bolt_delivery, endpoint_id = out.split()
        assert endpoint_id == other.id
        await receiver.wait_for(1, timeout=30)
        assert receiver.received[0].delivery_id == bolt_delivery

        code, out = await send(env, "--tenant", "acme", "--event", "stream.created",
                               "--payload", '{"fail_first": true}', "--stream", "s-1",
                               "--json")  # fmt: skip
        assert code == 0, out
        sent = json.loads(out)
        assert sent["routed"] is True and sent["tenant"] == "acme"
        assert sent["routing"] == "routed"
        assert [d["endpoint_id"] for d in sent["deliveries"]] == [streams.id]
        acme_delivery = sent["deliveries"][0]["delivery_id"]

        # The default tenant's event reaches the built-in endpoint: enqueue's delivery id.
        code, out = await send(env, "--event", "stream.updated", "--payload", "[1, 2]",
                               "--json")  # fmt: skip
        assert code == 0, out
        default = json.loads(out)["deliveries"]
        assert [d["endpoint_id"] for d in default] == ["default"]

        # An event no endpoint subscribes to: routed nowhere, said so.
        code, out = await send(env, "--tenant", "acme", "--event", "other.thing",
                               "--payload", "{}", "--json")  # fmt: skip
        assert code == 0, out
        unrouted = json.loads(out.splitlines()[0])
        assert unrouted["routed"] is True and unrouted["deliveries"] == []
        assert unrouted["routing"] == "unrouted"  # as the API's event says it
        assert "no endpoint of tenant 'acme' subscribes to 'other.thing'" in out

        acme_lines = await lines_of(acme)
        bolt_lines = await lines_of(bolt_only)
        all_lines = await lines_of(everyone)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):  # no --limit, no --for
            async with tail(env) as endless:
                endless.send_signal(sig)
                assert await asyncio.wait_for(endless.wait(), 30) == 0, sig

    received = receiver.by_delivery()
    assert [r.attempt for r in received[acme_delivery]] == [1, 2]
    assert len(received[default[0]["delivery_id"]]) == 1

    # acme's tail: exactly the two attempts of acme's delivery, nothing of bolt's.
    seen = [(a["delivery_id"], a["attempt"], a["outcome"], a["status_code"]) for a in acme_lines]
    assert seen == [(acme_delivery, 1, "retry", 500), (acme_delivery, 2, "delivered", 200)]
    for line in acme_lines:
        assert line["tenant"] == "acme" and line["endpoint_id"] == streams.id
        assert line["event_type"] == "stream.created" and line["stream_id"] == "s-1"
        assert line["duration_ms"] is not None and line["at"]
    assert acme_lines[0]["error"] == "HTTP 500"
    # One endpoint's tail: its one attempt.
    assert [(a["delivery_id"], a["endpoint_id"], a["tenant"]) for a in bolt_lines] == [
        (bolt_delivery, other.id, "bolt")
    ]
    # Unscoped: every tenant's attempts, each once.
    ids = [(a["delivery_id"], a["attempt"]) for a in all_lines]
    assert len(set(ids)) == 4
    assert {d for d, _ in ids} == {bolt_delivery, acme_delivery, default[0]["delivery_id"]}


def test_send_refuses_bad_input_and_says_when_nothing_routes_it(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [k for k in os.environ if k.startswith(("WEBHOOK_", "DATABASE_URL", "OTEL_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DATABASE_URL", database_url)

    def cli(*args: str) -> tuple[int, str]:
        code = main(list(args))
        got = capsys.readouterr()
        return code, got.out + got.err

    code, out = cli("send", "--event", "stream.updated", "--payload", '{"a": 1,')
    assert code == 2, out
    assert "--payload" in out and "is not valid JSON" in out and "Traceback" not in out
    code, out = cli("send", "--event", "stream.updated", "--payload", '{"a": NaN}')
    assert code == 2 and "--payload" in out and "NaN" in out
    code, out = cli("send", "--event", "x", "--payload", '{"a": "\\u0000"}')
    assert code == 2 and "--payload" in out and "NUL" in out
    # What enqueue refuses is a bad option too (a traceback and exit 1 before, which
    # reads as "no dispatcher routed it").
    for payload, said in (("[1e999]", "past a double's range"), ('"\ud800"', "surrogate")):
        code, out = cli("send", "--event", "x", "--payload", payload)
        assert code == 2 and "--payload" in out and said in out and "Traceback" not in out
    code, out = cli("send", "--event", "x", "--payload", "{}", "--stream", "s" * 501)
    assert code == 2 and "--stream: must be at most 500 characters (is 501)" in out, out
    code, out = cli("send", "--tenant", "bad tenant", "--event", "x", "--payload", "{}")
    assert code == 2 and "--tenant" in out
    code, out = cli("send", "--event", "bad\ttype", "--payload", "{}")
    assert code == 2 and "--event" in out
    code, out = cli("tail", "--for", "0")
    assert code == 2 and "--for" in out
    code, out = cli("tail", "--endpoint", "ep_missing", "--for", "1")
    assert code == 1 and "no endpoint 'ep_missing'" in out
    code, out = cli("tail", "--for", "0.3", "--json")  # nothing happens: ends, exit 0
    assert code == 0 and "tailing attempts of every tenant" in out and "{" not in out

    # No dispatcher running: enqueued, not routed within --wait (exit 1, and it says so).
    code, out = cli("send", "--event", "stream.updated", "--payload", "{}", "--wait", "0.3",
                    "--json")  # fmt: skip
    assert code == 1, out
    result = json.loads(out.splitlines()[0])
    assert result["routed"] is False and result["deliveries"] == []
    assert result["routing"] == "pending"
    assert "not routed within 0.3s" in out
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM webhook_outbox WHERE id = %s AND NOT processed",
            (result["event_id"],),
        ).fetchone()
    assert row == (1,)


def test_tail_on_a_terminal_shows_stored_text_as_data(capsys: pytest.CaptureFixture[str]) -> None:
    from fluxora_webhooks.commands.tail import _pretty_printer
    from fluxora_webhooks.tooling import Attempt

    show = _pretty_printer()
    show(
        Attempt(
            id=1, at=datetime(2026, 12, 1, 11, 0, 0, 123456, tzinfo=UTC), delivery_id="d-1",
            tenant="acme", endpoint_id="ep_1", event_type="stream.[bold]x[/bold]",
            stream_id="s", attempt=3, outcome="retry", status_code=503, duration_ms=12.5,
            error="HTTP 503 \x1b[31mred\x1b]0;title\x07",
        )
    )  # fmt: skip
    out = capsys.readouterr().out
    shown = datetime(2026, 12, 1, 11, 0, 0, 123456, tzinfo=UTC).astimezone()
    assert (
        shown.strftime("%H:%M:%S.123") in out
        and "retry" in out
        and "503" in out
        and "12.5 ms" in out
    )
    assert "ep_1" in out and "d-1 #3" in out
    assert "stream.[bold]x[/bold]" in out  # literal, never markup
    assert "\x1b" not in out and "\\x1b[31mred" in out and "\\x07" in out
