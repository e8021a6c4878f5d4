"""Traces from the producer's transaction to the consumer (SPEC 18), with a real service:
the producer's trace id in the consumer's ``traceparent`` on every attempt (a retry too),
the attempt spans exported by the console exporter, no malformed header for untraced or
badly traced plain-SQL rows, and, without the extra, a service that delivers (passing a
valid stored context through) and imports nothing of OpenTelemetry."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from fluxora_webhooks import enqueue
from tests.support.dispatch import SECRET
from tests.support.procs import DispatcherProcess, dispatcher_env
from tests.support.receiver import Received, Receiver

pytestmark = pytest.mark.e2e

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
STORED_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
STORED_PARENT = "00f067aa0ba902b7"
STORED = f"00-{STORED_TRACE}-{STORED_PARENT}-01"
MALFORMED = ("garbage", f"00-{'0' * 32}-{STORED_PARENT}-01", f"00-{STORED_TRACE}-zz-01")


def fail_first_attempt(item: Received) -> web.Response:
    """500 on every first attempt of a stream named retry-*, 200 otherwise."""
    stream = json.loads(item.body).get("stream", "")
    if stream.startswith("retry") and item.attempt == 1:
        return web.Response(status=500, text="try again")
    return web.Response(status=200, text="ok")


def insert_plain(
    database_url: str, stream: str, traceparent: str | None, state: str | None
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, traceparent, tracestate)"
            " VALUES (%s, 'stream.updated', %s::jsonb, %s, %s)",
            (stream, json.dumps({"stream": stream}), traceparent, state),
        )


async def run_service(
    env: dict[str, str], log_path: Path, receiver: Receiver, expected: int, *argv: str
) -> DispatcherProcess:
    """``run`` (``argv``: the interpreter's arguments before it) until ``expected``
    requests arrived, then SIGTERM; the process has exited when this returns."""
    log_file = log_path.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, env=env, stdout=log_file, stderr=asyncio.subprocess.STDOUT
    )
    log_file.close()
    service = DispatcherProcess(proc, log_path)
    try:
        await receiver.wait_for(expected, timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{service.log()}") from None
    finally:
        service.terminate()
        try:
            code = await service.wait(30)
        except TimeoutError:
            service.kill()
            await service.wait(10)
            raise
    assert code == 0, service.log()
    return service


def by_stream(receiver: Receiver) -> dict[str, list[Received]]:
    out: dict[str, list[Received]] = {}
    for item in receiver.received:
        out.setdefault(json.loads(item.body)["stream"], []).append(item)
    for items in out.values():
        items.sort(key=lambda r: r.attempt)
    return out


def exported_spans(log: str) -> list[dict[str, Any]]:
    spans = []
    for line in log.splitlines():
        if line.startswith("{"):
            span = json.loads(line)
            if span.get("name") == "webhook.attempt":
                spans.append(span)
    return spans


async def test_producer_trace_reaches_the_consumer_on_every_attempt_and_spans_are_exported(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    receiver.respond = fail_first_attempt
    producer = TracerProvider().get_tracer("producer")
    with (
        producer.start_as_current_span("api request") as span,
        psycopg.connect(database_url) as conn,
    ):
        with conn.transaction():
            enqueue(
                conn, stream_id="retry-traced", event_type="stream.updated",
                payload={"stream": "retry-traced"},
            )  # fmt: skip
        context = span.get_span_context()
    producer_trace = trace.format_trace_id(context.trace_id)
    producer_span = trace.format_span_id(context.span_id)
    insert_plain(database_url, "retry-stored", STORED, "vendor=abc")
    insert_plain(database_url, "untraced", None, None)
    insert_plain(database_url, "retry-untraced", None, None)
    for i, bad in enumerate(MALFORMED):
        insert_plain(database_url, f"malformed-{i}", bad, "vendor=abc")

    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_RETRY_SCHEDULE="100ms", WEBHOOK_POLL_INTERVAL_MS="200",
        OTEL_TRACES_EXPORTER="console", OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_SERVICE_NAME="fluxora-under-test",
    )  # fmt: skip
    expected = 2 + 2 + 1 + 2 + len(MALFORMED)
    service = await run_service(
        env, tmp_path / "service.log", receiver, expected, "-m", "fluxora_webhooks", "run"
    )
    got = by_stream(receiver)

    # The producer's trace on both attempts, each naming a span of its own.
    traced = got["retry-traced"]
    assert [r.attempt for r in traced] == [1, 2]
    parents = []
    for item in traced:
        match = TRACEPARENT.fullmatch(item.headers["traceparent"])
        assert match is not None, item.headers["traceparent"]
        assert match.group(1) == producer_trace
        parents.append(match.group(2))
    assert len(set(parents)) == 2 and producer_span not in parents

    # A plain-SQL row's stored context: its trace and its tracestate on every attempt.
    stored = got["retry-stored"]
    assert [r.attempt for r in stored] == [1, 2]
    for item in stored:
        match = TRACEPARENT.fullmatch(item.headers["traceparent"])
        assert match is not None and match.group(1) == STORED_TRACE
        assert match.group(2) != STORED_PARENT
        assert item.headers["tracestate"] == "vendor=abc"

    # No context, or a malformed one: a fresh, valid trace (never a malformed header).
    fresh = [got["untraced"][0], *(got[f"malformed-{i}"][0] for i in range(len(MALFORMED)))]
    fresh_traces = set()
    for item in fresh:
        match = TRACEPARENT.fullmatch(item.headers["traceparent"])
        assert match is not None, item.headers["traceparent"]
        assert match.group(1) not in (producer_trace, STORED_TRACE, "0" * 32)
        fresh_traces.add(match.group(1))
        assert "tracestate" not in item.headers
    assert len(fresh_traces) == len(fresh)
    # ... the delivery's own: every attempt of one delivery in one trace, derived from its
    # id (hashed: a ratio sampler reads bits a UUID fixes).
    untraced = got["retry-untraced"]
    assert [r.attempt for r in untraced] == [1, 2]
    matches = [TRACEPARENT.fullmatch(r.headers["traceparent"]) for r in untraced]
    assert all(m is not None for m in matches)
    digest = hashlib.blake2b(untraced[0].delivery_id.encode(), digest_size=16).hexdigest()
    assert {m.group(1) for m in matches if m} == {digest}
    assert len({m.group(2) for m in matches if m}) == 2  # a span of its own each

    # The exported spans: the producer's trace, parented on the producer's span, named in
    # the headers, with the attempt's attributes; no URL query, no secret.
    log = service.log()
    spans = exported_spans(log)
    mine = sorted(
        (s for s in spans if s["context"]["trace_id"] == f"0x{producer_trace}"),
        key=lambda s: s["attributes"]["fluxora.attempt"],
    )
    assert len(mine) == 2, log
    assert [s["context"]["span_id"] for s in mine] == [f"0x{p}" for p in parents]
    assert all(s["parent_id"] == f"0x{producer_span}" for s in mine)
    assert all(s["kind"] == "SpanKind.CLIENT" for s in mine)
    first, second = (s["attributes"] for s in mine)
    assert first["fluxora.outcome"] == "retry" and first["http.response.status_code"] == 500
    assert second["fluxora.outcome"] == "delivered" and second["http.response.status_code"] == 200
    assert first["error.type"] == "500" and "error.type" not in second  # OTel's convention
    for attributes in (first, second):
        assert attributes["fluxora.endpoint.id"] == "default"
        assert attributes["fluxora.tenant"] == ""
        assert attributes["fluxora.event.type"] == "stream.updated"
        assert attributes["fluxora.delivery.id"] == traced[0].delivery_id
        assert attributes["server.address"] == "127.0.0.1"
    assert mine[0]["resource"]["attributes"]["service.name"] == "fluxora-under-test"
    assert len(spans) == expected  # one span per attempt
    assert "sekrit-query-token" not in log and "/hook" not in json.dumps(spans)
    assert SECRET.decode() not in log


BLOCKED_RUN = """
import json, sys

class NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, NoOpenTelemetry())
from fluxora_webhooks.cli import main

code = main(["run"])
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
print("OPENTELEMETRY-MODULES " + json.dumps(loaded), flush=True)
sys.exit(code)
"""


async def test_without_the_extra_the_service_delivers_and_imports_no_opentelemetry(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    receiver.respond = fail_first_attempt
    insert_plain(database_url, "retry-stored", STORED, "vendor=abc")
    insert_plain(database_url, "untraced", None, None)
    for i, bad in enumerate(MALFORMED):
        insert_plain(database_url, f"malformed-{i}", bad, "vendor=abc")
    # Traces asked for, but the extra cannot be imported: a warning, and deliveries go on.
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        WEBHOOK_RETRY_SCHEDULE="100ms", WEBHOOK_POLL_INTERVAL_MS="200",
        OTEL_TRACES_EXPORTER="console",
    )  # fmt: skip
    expected = 2 + 1 + len(MALFORMED)
    service = await run_service(
        env, tmp_path / "service.log", receiver, expected, "-c", BLOCKED_RUN
    )
    log = service.log()
    loaded = re.search(r"^OPENTELEMETRY-MODULES (.*)$", log, re.MULTILINE)
    assert loaded is not None, log
    assert json.loads(loaded.group(1)) == []
    assert "fluxora-webhooks[otel] is not installed" in log

    got = by_stream(receiver)
    # The stored context passed through as it is, on both attempts.
    assert [r.attempt for r in got["retry-stored"]] == [1, 2]
    for item in got["retry-stored"]:
        assert item.headers["traceparent"] == STORED
        assert item.headers["tracestate"] == "vendor=abc"
    # None, or a malformed one: no trace header at all.
    for stream in ("untraced", *(f"malformed-{i}" for i in range(len(MALFORMED)))):
        assert "traceparent" not in got[stream][0].headers
        assert "tracestate" not in got[stream][0].headers
    assert exported_spans(log) == []


def test_enqueue_stores_the_w3c_context_whatever_the_global_propagator(
    database_url: str,
) -> None:
    """A producer whose OTEL_PROPAGATORS installs only baggage (or b3) still stores its
    trace context: the column and the consumer's request are W3C (it stored nothing)."""
    from opentelemetry import propagate
    from opentelemetry.baggage.propagation import W3CBaggagePropagator

    before = propagate.get_global_textmap()
    propagate.set_global_textmap(W3CBaggagePropagator())
    try:
        tracer = TracerProvider().get_tracer("producer")
        with (
            tracer.start_as_current_span("api request") as span,
            psycopg.connect(database_url) as conn,
        ):
            with conn.transaction():
                enqueue(conn, stream_id="baggage-only", event_type="stream.updated", payload={})
            context = span.get_span_context()
    finally:
        propagate.set_global_textmap(before)
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT traceparent FROM webhook_outbox WHERE stream_id = 'baggage-only'"
        ).fetchone()
    trace_id, span_id = (
        trace.format_trace_id(context.trace_id),
        trace.format_span_id(context.span_id),
    )
    assert row is not None and row[0] is not None
    match = TRACEPARENT.fullmatch(row[0])
    assert match is not None and match.groups() == (trace_id, span_id), row


async def test_a_collector_that_never_answers_holds_the_stop_only_the_flush_bound(
    database_url: str, redis_url: str, redis_prefix: str, receiver: Receiver, tmp_path: Path
) -> None:
    """Spans for a collector that takes the connection and never answers: the stop waits
    for them at most the flush bound (5 s) and says they were not flushed; the exporter's
    own timeout (30 s here) held the exit before, past a container's stop timeout."""
    held: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()

    collector = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = collector.sockets[0].getsockname()[1]
    insert_plain(database_url, "spanned", STORED, None)
    env = dispatcher_env(
        database_url, redis_url, receiver.url, redis_prefix,
        OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_TIMEOUT="30", OTEL_BSP_SCHEDULE_DELAY="100",
    )  # fmt: skip
    log_path = tmp_path / "service.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fluxora_webhooks", "run",
            env=env, stdout=log_file, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    service = DispatcherProcess(proc, log_path)
    try:
        await receiver.wait_for(1, timeout=30)
        for _ in range(100):  # the span's export has reached the collector, and hangs
            if held:
                break
            await asyncio.sleep(0.05)
        assert held, service.log()
        started = time.monotonic()
        service.terminate()
        code = await service.wait(25)
        took = time.monotonic() - started
    finally:
        if proc.returncode is None:
            service.kill()
            await service.wait(10)
        for writer in held:
            writer.close()
        collector.close()
    log = service.log()
    assert code == 0, log
    assert "spans not flushed after 5000 ms" in log, log
    assert took < 20, (took, log)  # the bound is 5 s; the exporter would have held 30
