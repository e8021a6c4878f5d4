"""The many-endpoint benchmark: fan-out, its latency, ordered streams and isolation, each
against the raw HTTP limit on the same receiver process.

    python benchmarks/many.py            # full (a few minutes on 2 cores)
    python benchmarks/many.py --quick    # smaller
    python benchmarks/many.py --tiny     # seconds: the smoke test

Sections (``--only`` picks some):

- ``raw``: the HTTP limit, ``rawhttp.py`` blasting the receiver (as ``run.py`` measures it:
  the best of one client process and one per CPU).
- ``fanout``: events of one tenant fanned out to 100 endpoints (each its own path on the
  receiver), delivered by one ``fluxora-webhooks run`` as a user starts it (its supervisor
  and one worker per CPU) and by one worker process alone, each with the defaults and with
  ``WEBHOOK_BATCH_SIZE=100``: deliveries per second from the producer's commit to the
  last receipt.
- ``fanout_latency``: commit-to-receipt at a steady rate, each event its own transaction
  carrying its commit time, fanned out to 10 endpoints.
- ``ordered``: one ordered endpoint, many streams of several events each, all in one
  transaction; deliveries per second, the receiver's check that each stream arrived in
  order, and the same load to an unordered endpoint; bursts to the two alternate for a few
  rounds and the fastest of each is compared (every round's rate is kept).
- ``ordered_head``: an ordered endpoint at a steady rate over many streams, then the same
  with one stream's head refused (503) for a moment: the other streams' commit-to-receipt
  latency in both runs, and how long the waiting stream's events wait (for the head's
  retry, the first step of ``WEBHOOK_RETRY_SCHEDULE``), all in order.
- ``isolation``: 20 healthy endpoints (``--isolation 900:100``: any number), each its own
  tenant, alone, then beside as many healthy ones again (the all-healthy run), then beside
  one (or many) that reads each request and never answers (the sender waits for its
  timeout), the others getting their share of the same traffic: the healthy endpoints'
  throughput (the best of two bursts each) and commit-to-receipt latency, the latter
  measured while the hanging endpoints' backlog is still there.
- ``burst``: cross-tenant head-of-line blocking. Tenant B (one endpoint) enqueues a steady
  ``burst_rate`` events/s, each its own transaction carrying its commit time: its
  commit-to-receipt latency alone (``burst_alone_seconds``), then while tenant A (its own
  endpoint on the same receiver) has just enqueued ``burst_events`` events in one
  transaction, from A's commit until A's backlog is drained (A's last receipt); A's drain
  time and rate. B's events committed while A's insert was still open are kept apart.

Endpoints are registered through the Python API (``fluxora_webhooks.endpoints.create``).
It prints one table, saves ``benchmarks/results/many-<timestamp>.json``. Databases are
named ``bench_many_*`` (``--db-prefix``) and dropped at the end; Redis keys carry a prefix
of their own and are deleted. ``--ports LO-HI``: the receiver and the dispatchers' metrics
ports from that range (default: any free port).

``ManyBench.sections(...)`` runs sections against a receiver someone else started (the
main benchmark, for one): pass its URL, its child process and the children registry.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import PAD, ahttp_json, dig, free_port, percentile, run
from plumbing import Plumbing, add_common_arguments, with_dbname
from procs import Child, Children, CpuMeter, process_tree

HERE = Path(__file__).resolve().parent
DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
SECTIONS = ("raw", "fanout", "fanout_latency", "ordered", "ordered_head", "isolation", "burst")

# Targets (issues 12, 13, 16).
FANOUT_RAW_MIN = 0.6
LATENCY_P50_MAX_MS = 5.0
LATENCY_P99_MAX_MS = 25.0
ORDERED_RATIO_MIN = 0.8
ISOLATION_RATIO_MIN = 0.8
ISOLATION_P99_MAX_MS = 50.0
# Bursts of the isolation section, alone and beside the hanging endpoints: the best of each.
ISOLATION_ROUNDS = 2
# ordered_head's second endpoint: a retry limit of its own, above the section's rate.
HEAD_RATE_LIMIT = 1000
# A dispatcher's environment value meaning "leave the variable out" (its default applies).
UNSET = ""
# What `run` starts by default: one worker per usable CPU (as the supervisor counts them).
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class Preset:
    raw_requests: int
    raw_concurrency: tuple[int, ...]
    fanout_endpoints: int
    fanout_events: int  # x fanout_endpoints deliveries
    latency_endpoints: int
    latency_rate: int
    latency_seconds: float
    ordered_streams: int
    ordered_per_stream: int
    healthy: int
    isolation_events: int  # per endpoint (x healthy deliveries)
    isolation_rate: int  # events/s, taking turns over the endpoints' tenants
    isolation_seconds: float
    timeout_ms: int | None = None  # the dispatcher's WEBHOOK_TIMEOUT_MS (None: its default)
    hanging: int = 1  # endpoints that never answer, beside the healthy ones
    extra: dict[str, str] = field(default_factory=dict)
    # ordered_head: events/s over this many streams of an ordered endpoint, for this long,
    # one stream's head refused (503) for head_fail_s, so that it waits for its retry.
    head_streams: int = 100
    head_rate: int = 200
    head_seconds: float = 10.0
    head_fail_s: float = 1.0
    ordered_rounds: int = 3  # ordered section: alternating bursts, the best of each
    # burst: tenant A's events in one transaction; tenant B's steady rate beside them, and
    # how long B runs alone first.
    burst_events: int = 50_000
    burst_rate: int = 20
    burst_alone_seconds: float = 5.0
    burst_analyze: bool = False  # ANALYZE the outbox right after A's commit


PRESETS = {
    "full": Preset(30_000, (16, 64, 128), 100, 1000, 10, 200, 10.0, 1000, 20, 20, 2000, 400, 10.0),
    "quick": Preset(
        15_000,
        (64,),
        100,
        300,
        10,
        200,
        5.0,
        1000,
        10,
        20,
        500,
        400,
        5.0,
        head_seconds=5.0,
        burst_events=20_000,
    ),
    # Every section, seconds; a short timeout so the hanging endpoint's requests end.
    "tiny": Preset(
        2000,
        (16,),
        100,
        10,
        10,
        20,
        1.0,
        50,
        4,
        20,
        20,
        100,
        1.0,
        timeout_ms=2000,
        head_streams=10,
        head_rate=50,
        head_seconds=1.0,
        ordered_rounds=1,
        head_fail_s=0.2,
        burst_events=2000,
        burst_alone_seconds=1.0,
    ),
}


def interleave(many: Sequence[str], few: Sequence[str]) -> list[str]:
    """``many`` with ``few`` spread evenly among them (one round of a steady run)."""
    if not few:
        return list(many)
    out: list[str] = []
    step = len(many) / len(few)
    j = 0
    for i, item in enumerate(many):
        while j < len(few) and j * step <= i:
            out.append(few[j])
            j += 1
        out.append(item)
    out.extend(few[j:])
    return out


def _ratio(value: float | None, base: float | None) -> float | None:
    if not value or not base or value != value or base != base:
        return None
    return value / base


class ManyBench(Plumbing):
    def __init__(
        self,
        preset: Preset,
        *,
        admin_url: str = DEFAULT_PG,
        redis_url: str = DEFAULT_REDIS,
        overrides: dict[str, str] | None = None,
        children: Children | None = None,
        tmp: Path | None = None,
        db_prefix: str = "bench_many_",
        ports: tuple[int, int] | None = None,
    ) -> None:
        self.preset = preset
        self.admin_url = admin_url
        self.redis_url = redis_url
        self.overrides = dict(overrides or {})
        self.run_id = uuid.uuid4().hex[:8]
        self.prefix = f"bench:{self.run_id}:"
        self.tmp = tmp or Path(tempfile.mkdtemp(prefix="fluxora-many-"))
        self.children = children or Children(self.tmp)
        self.databases: list[str] = []
        self.db_prefix = db_prefix
        self.ports = ports  # (lowest, highest) for the receiver and metrics; None: any
        self.receiver_url = ""
        self.receiver: Child | None = None
        self.database_url = ""
        self.current: tuple[dict[str, str], Child] | None = None

    # -- plumbing --------------------------------------------------------------------

    def log(self, text: str) -> None:
        print(f"[many {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    async def database(self) -> str:
        """One database for every section (each has tenants and endpoints of its own)."""
        if not self.database_url:
            self.database_url = await self.create_database("db")
        return self.database_url

    async def create_database(self, suffix: str) -> str:
        name = f"{self.db_prefix}{suffix}_{self.run_id}"
        async with await psycopg.AsyncConnection.connect(self.admin_url, autocommit=True) as c:
            await c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.databases.append(name)
        url = with_dbname(self.admin_url, name)
        await self.migrate(url)
        return url

    def free_port(self) -> int:
        """A port nothing listens on: any (the system's pick), or one of ``--ports``."""
        if self.ports is None:
            return free_port()
        import socket

        lo, hi = self.ports
        for port in range(lo, hi + 1):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
        raise RuntimeError(f"no free port in {lo}-{hi}")

    async def start_receiver(self) -> None:
        wanted = "0" if self.ports is None else str(self.free_port())
        receiver = await self.children.script("receiver", "receiver.py", "--port", wanted)
        port = int((await receiver.wait_for_line("PORT ", 15)).split()[1])
        self.receiver_url = f"http://127.0.0.1:{port}"
        self.receiver = receiver

    def dispatcher_env(self, database_url: str, port: int, extra: dict[str, str]) -> dict[str, str]:
        keep = ("DATABASE_URL", "REDIS_URL", "WEBHOOK_", "LOG_FORMAT", "FLUXORA_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(keep)}
        env.update(
            {
                "DATABASE_URL": database_url,
                "REDIS_URL": self.redis_url,
                # Only the endpoints of the table: no built-in default endpoint.
                "WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8",
                "WEBHOOK_METRICS_PORT": str(port),
                "FLUXORA_REDIS_PREFIX": self.prefix,
                "FLUXORA_HOME": str(self.tmp / "home"),
                # One process, as run.py's "ours" rows (--set WEBHOOK_WORKERS=... to change).
                "WEBHOOK_WORKERS": "1",
            }
        )
        if self.preset.timeout_ms is not None:
            env["WEBHOOK_TIMEOUT_MS"] = str(self.preset.timeout_ms)
        env.update(self.preset.extra)
        env.update(self.overrides)
        env.update(extra)
        return {k: v for k, v in env.items() if v != UNSET}

    async def dispatcher(self, extra: dict[str, str] | None = None) -> Child:
        """The one running ``fluxora-webhooks run``, with ``extra`` in its environment: the
        one already running when its environment is the same, else a new one (never two at
        once: both would deliver)."""
        extra = extra or {}
        if (
            self.current is not None
            and self.current[0] == extra
            and (self.current[1].proc.returncode is None)
        ):
            return self.current[1]
        await self.stop_dispatcher()
        tag = "-".join(f"{k}={v}" for k, v in sorted(extra.items())) or "defaults"
        child = await self.start_dispatcher(await self.database(), tag, extra)
        self.current = (extra, child)
        return child

    async def stop_dispatcher(self) -> None:
        if self.current is not None:
            await self.current[1].stop()
            self.current = None

    async def start_dispatcher(
        self, database_url: str, tag: str, extra: dict[str, str] | None = None
    ) -> Child:
        port = self.free_port()
        env = self.dispatcher_env(database_url, port, extra or {})
        child = await self.children.spawn(
            f"many-{tag}", [sys.executable, "-m", "fluxora_webhooks", "run"], env
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and child.proc.returncode is None:
            with contextlib.suppress(Exception):
                await ahttp_json(f"http://127.0.0.1:{port}/readyz", timeout=1)
                if env.get("WEBHOOK_WORKERS") != "1":  # a supervisor: its workers start after
                    await self.wait_workers([child], int(env.get("WEBHOOK_WORKERS") or CPUS))
                await asyncio.sleep(0.3)  # claim loops connect after /readyz answers
                return child
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{child.name} did not become ready:\n{child.log()[-3000:]}")

    async def add_endpoints(
        self,
        database_url: str,
        tenant: str | Sequence[str],
        paths: Sequence[str],
        *,
        ordered: bool = False,
        rate_limit: int | None = None,
    ) -> list[str]:
        """One endpoint per path: all of ``tenant``, or each of its own (a list, one per
        path: a customer per endpoint)."""
        from fluxora_webhooks import endpoints

        allowed = [ipaddress.ip_network("127.0.0.0/8")]
        tenants = [tenant] * len(paths) if isinstance(tenant, str) else list(tenant)
        assert len(tenants) == len(paths)
        ids = []
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            for path, owner in zip(paths, tenants, strict=True):
                endpoint, _ = await endpoints.create(
                    c,
                    url=self.receiver_url + path,
                    tenant=owner,
                    ordered=ordered,
                    rate_limit=rate_limit,
                    allowed_networks=allowed,
                )
                ids.append(endpoint.id)
        return ids

    async def insert_events(self, database_url: str, tenant: str | Sequence[str], n: int) -> None:
        """N events of each tenant in one transaction, by plain SQL (several tenants:
        interleaved, the first event of each, then the second...)."""
        tenants = [tenant] if isinstance(tenant, str) else list(tenant)
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await c.execute(
                "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                " SELECT t, 'stream-' || g, 'bench.event',"
                " jsonb_build_object('kind', 'bench', 'seq', g, 'pad', %(pad)s::text)"
                " FROM generate_series(1, %(n)s) g, unnest(%(tenants)s::text[])"
                " WITH ORDINALITY AS u(t, o) ORDER BY g, o",
                {"tenants": tenants, "n": n, "pad": PAD},
            )

    async def truncate(self, database_url: str) -> None:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await c.execute("TRUNCATE webhook_outbox, webhook_dead_letter")

    async def pending(self, database_url: str, endpoint_ids: Sequence[str] | None = None) -> int:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            if endpoint_ids is None:
                cur = await c.execute("SELECT count(*) FROM webhook_outbox WHERE NOT processed")
            else:
                cur = await c.execute(
                    "SELECT count(*) FROM webhook_outbox"
                    " WHERE NOT processed AND endpoint_id = ANY(%s)",
                    (list(endpoint_ids),),
                )
            row = await cur.fetchone()
            return int(row[0]) if row else -1

    async def claims(self, database_url: str, endpoint_ids: Sequence[str]) -> dict[str, int]:
        """How often the endpoints' rows were claimed: rows, and deferrals among them (each
        deferral is a claim that sent nothing)."""
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            cur = await c.execute(
                "SELECT count(*), COALESCE(sum(deferrals), 0) FROM webhook_outbox"
                " WHERE endpoint_id = ANY(%s)",
                (list(endpoint_ids),),
            )
            row = await cur.fetchone()
            return {"rows": int(row[0]), "deferrals": int(row[1])} if row else {}

    async def burst(
        self,
        database_url: str,
        tenant: str | Sequence[str],
        events: int,
        deliveries: int,
        dispatcher: Child,
        *,
        rounds: int = 1,
    ) -> dict[str, Any]:
        """Insert ``events`` (of each tenant) at once; wait for ``deliveries`` receipts;
        their rate. With ``rounds``: the fastest of that many bursts (other load on a
        shared machine only ever slows a run down), each on an emptied outbox, every
        round's rate kept."""
        assert self.receiver is not None
        runs = []
        for _ in range(rounds):
            if rounds > 1:
                await self.truncate(database_url)
            await self.reset()
            meter = CpuMeter(
                {"dispatcher": process_tree(dispatcher.pid), "receiver": [self.receiver.pid]}
            )
            meter.start()
            await self.insert_events(database_url, tenant, events)
            committed = time.time()
            stats = await self.wait_count(deliveries, max(60.0, deliveries / 200))
            cpu = meter.stop()
            rate = self.rate_since(stats, committed)
            runs.append(
                {
                    "events": events,
                    "deliveries": deliveries,
                    "received": stats["count"],
                    "hung": stats["hung"],  # requests read by hanging endpoints, unanswered
                    "rate": rate,
                    "rate_first_to_last_receipt": self.rate(stats),
                    "cpu_pct": cpu,
                    "dispatcher_cpu_us_per_delivery": round(
                        10_000 * cpu.get("dispatcher", 0) / rate, 1
                    )
                    if rate == rate and rate > 0
                    else None,
                }
            )
        best = _fastest(runs)
        if rounds > 1:
            best["hung_all_rounds"] = sum(r["hung"] for r in runs)
        return best

    async def steady(
        self,
        database_url: str,
        tenant: str | Sequence[str],
        rate: int,
        seconds: float,
        fan: int,
        *,
        answering: Collection[str] | None = None,
    ) -> dict[str, Any]:
        """Events at a steady rate, each its own transaction carrying its commit time (the
        receiver records receipt minus that time for every delivery of it). Several
        tenants take turns; ``answering``: the tenants whose endpoints answer (default
        all), so the receipts to wait for."""
        await self.reset()
        tenants = [tenant] if isinstance(tenant, str) else list(tenant)
        total = int(rate * seconds)
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute("SELECT 1")
            start = time.perf_counter() + 0.1
            for i in range(total):
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await conn.execute(
                    "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                    " VALUES (%s, %s, 'bench.latency', jsonb_build_object('kind', 'latency',"
                    " 'seq', %s::int, 't0', %s::float8))",
                    (tenants[i % len(tenants)], f"lat-{i}", i, time.time()),
                )
        owners = [tenants[i % len(tenants)] for i in range(total)]
        expected = fan * sum(1 for t in owners if answering is None or t in answering)
        stats = await self.wait_count(expected, 60)
        lat = sorted(stats["latencies_ms"])
        return {
            "rate": rate,
            "seconds": seconds,
            "events": total,
            "endpoints": fan,
            "received": stats["count"],
            "p50_ms": percentile(lat, 50),
            "p95_ms": percentile(lat, 95),
            "p99_ms": percentile(lat, 99),
            "max_ms": lat[-1] if lat else float("nan"),
        }

    # -- sections --------------------------------------------------------------------

    async def section_raw(self) -> dict[str, Any]:
        """The best of one client process and one per CPU (issue 16's raw limit)."""
        runs = [
            await self.raw_run(conc, processes, self.preset.raw_requests)
            for processes in sorted({1, os.cpu_count() or 1})
            for conc in self.preset.raw_concurrency
        ]
        return {"runs": runs, "best": max(runs, key=lambda r: r["rate"])}

    async def section_fanout(self) -> dict[str, Any]:
        p = self.preset
        url = await self.database()
        await self.add_endpoints(url, "fan", [f"/fan/ep-{i}" for i in range(p.fanout_endpoints)])
        runs = []
        # One `run` as a user starts it (WEBHOOK_WORKERS unset: one worker per CPU), then one
        # worker process alone; the tuned runs first: the sections after this one share the
        # default dispatcher (one worker, defaults).
        one_run = {"WEBHOOK_WORKERS": UNSET}
        for label, extra in (
            ("one run, batch 100", {**one_run, "WEBHOOK_BATCH_SIZE": "100"}),
            ("one run, defaults", one_run),
            ("1 process, batch 100", {"WEBHOOK_BATCH_SIZE": "100"}),
            ("1 process, defaults", {}),
        ):
            await self.truncate(url)
            dispatcher = await self.dispatcher(extra)
            result = await self.burst(
                url, "fan", p.fanout_events, p.fanout_events * p.fanout_endpoints, dispatcher
            )
            result.update(label=label, env=extra, endpoints=p.fanout_endpoints)
            self.log(f"fanout x{p.fanout_endpoints} {label}: {result['rate']:,.0f} deliveries/s")
            runs.append(result)
        return {"runs": runs, "best": max(runs, key=lambda r: r["rate"])}

    async def section_fanout_latency(self) -> dict[str, Any]:
        p = self.preset
        url = await self.database()
        await self.add_endpoints(
            url, "lat", [f"/latency/ep-{i}" for i in range(p.latency_endpoints)]
        )
        await self.truncate(url)
        await self.dispatcher()
        result = await self.steady(
            url, "lat", p.latency_rate, p.latency_seconds, p.latency_endpoints
        )
        self.log("fanout latency p50 {p50_ms:.2f} ms, p99 {p99_ms:.2f} ms".format(**result))
        return result

    async def section_ordered(self) -> dict[str, Any]:
        p = self.preset
        url = await self.database()
        await self.add_endpoints(url, "ord", ["/ordered/ep"], ordered=True)
        await self.add_endpoints(url, "unord", ["/unordered/ep"])
        dispatcher = await self.dispatcher()
        out: dict[str, Any] = {"streams": p.ordered_streams, "per_stream": p.ordered_per_stream}
        runs: dict[str, list[dict[str, Any]]] = {"ord": [], "unord": []}
        # Rounds of one ordered and one unordered burst, alternating; the fastest of each
        # (other load on a shared machine only ever slows a burst down), every round kept.
        for _ in range(p.ordered_rounds):
            for tenant in ("ord", "unord"):
                runs[tenant].append(await self._ordered_burst(url, tenant, dispatcher))
        for tenant, mine in runs.items():
            best = _fastest(mine)
            # Every round counts for the order, not just the fastest one.
            best["out_of_order"] = sum(r["out_of_order"] for r in mine)
            best["repeats"] = sum(r["repeats"] for r in mine)
            best["streams_seen"] = min(r["streams_seen"] for r in mine)
            out[tenant] = best
        out["in_order"] = (
            out["ord"]["out_of_order"] == 0 and out["ord"]["streams_seen"] == p.ordered_streams
        )
        out["round_ratios"] = [
            _ratio(o["rate"], u["rate"]) for o, u in zip(runs["ord"], runs["unord"], strict=True)
        ]
        out["ratio"] = _ratio(out["ord"]["rate"], out["unord"]["rate"])
        return out

    async def _ordered_burst(self, url: str, tenant: str, dispatcher: Child) -> dict[str, Any]:
        """One burst of the ordered section to ``tenant``'s endpoint, on an emptied outbox."""
        p = self.preset
        total = p.ordered_streams * p.ordered_per_stream
        await self.truncate(url)
        await self.reset()
        assert self.receiver is not None
        meter = CpuMeter(
            {"dispatcher": process_tree(dispatcher.pid), "receiver": [self.receiver.pid]}
        )
        meter.start()
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
            # One transaction; a stream's events in order of their ids.
            await c.execute(
                "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                " SELECT %(tenant)s, 'st-' || s, 'bench.ordered',"
                " jsonb_build_object('kind', 'ordered', 'stream', 'st-' || s,"
                " 'seq', k, 'pad', %(pad)s::text)"
                " FROM generate_series(1, %(per)s) k, generate_series(1, %(streams)s) s"
                " ORDER BY k, s",
                {
                    "tenant": tenant,
                    "per": p.ordered_per_stream,
                    "streams": p.ordered_streams,
                    "pad": PAD,
                },
            )
        committed = time.time()
        stats = await self.wait_count(total, max(60.0, total / 100))
        cpu = meter.stop()
        rate = self.rate_since(stats, committed)
        self.log(f"{tenant}ered {total}: {rate:,.0f} deliveries/s")
        return {
            "deliveries": total,
            "received": stats["count"],
            "rate": rate,
            "rate_first_to_last_receipt": self.rate(stats),
            "cpu_pct": cpu,
            "streams_seen": stats["streams"],
            "out_of_order": stats["out_of_order"],
            "repeats": stats["repeats"],
        }

    async def section_ordered_head(self) -> dict[str, Any]:
        """An ordered endpoint at a steady rate over many streams, each event its own
        transaction carrying its commit time: first as it is, then with one stream's head
        refused (503) for a moment, so that the stream waits for the head's retry (the
        first of WEBHOOK_RETRY_SCHEDULE) while the other streams go on. The other streams'
        commit-to-receipt latency in both runs, and the waiting stream's."""
        p = self.preset
        url = await self.database()
        await self.add_endpoints(url, "head", ["/ordered/head"], ordered=True)
        # The same with a retry limit of its own above its traffic (SPEC 5 holds a retry
        # while the endpoint takes WEBHOOK_RETRY_RPS attempts a second, new events included).
        await self.add_endpoints(
            url, "head-limit", ["/ordered/head-limit"], ordered=True, rate_limit=HEAD_RATE_LIMIT
        )
        await self.dispatcher()
        out: dict[str, Any] = {
            "streams": p.head_streams,
            "rate": p.head_rate,
            "seconds": p.head_seconds,
            "head_refused_s": p.head_fail_s,
        }
        runs = (
            ("all_flowing", "head", False),
            ("head_retrying", "head", True),
            ("head_retrying_own_limit", "head-limit", True),
        )
        for label, tenant, stuck in runs:
            await self.truncate(url)
            await self.reset()
            total = int(p.head_rate * p.head_seconds)
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                start = time.perf_counter() + 0.1
                fail_until = time.time() + 0.1 + p.head_fail_s
                for i in range(total):
                    delay = start + i / p.head_rate - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    watched = stuck and i % 10 == 0  # a tenth of the events: the stuck stream
                    stream = "stuck" if watched else f"st-{i % p.head_streams}"
                    event: dict[str, Any] = {"stream": stream, "seq": i, "t0": time.time()}
                    if watched:
                        event["watch"] = True
                        if i == 0:
                            event["fail_until"] = fail_until
                    await conn.execute(
                        "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                        " VALUES (%s, %s, 'bench.ordered', %s::jsonb)",
                        (tenant, stream, json.dumps(event)),
                    )
            stats = await self.wait_count(total, 120)
            others = sorted(stats["latencies_ms"])
            watched_ms = sorted(stats["watched_ms"])
            out[label] = {
                "events": total,
                "received": stats["count"],
                "refused": stats["refused"],
                "out_of_order": stats["out_of_order"],
                "others_p50_ms": percentile(others, 50),
                "others_p99_ms": percentile(others, 99),
                "others_max_ms": others[-1] if others else float("nan"),
                "stuck_events": len(watched_ms),
                "stuck_p50_ms": percentile(watched_ms, 50) if watched_ms else None,
                "stuck_max_ms": watched_ms[-1] if watched_ms else None,
            }
            self.log(
                "ordered {l}: others p99 {p:.1f} ms; stuck stream max {m}".format(
                    l=label,
                    p=out[label]["others_p99_ms"],
                    m="-" if not watched_ms else f"{watched_ms[-1]:,.0f} ms",
                )
            )
        out["in_order"] = all(out[label]["out_of_order"] == 0 for label, _, _ in runs)
        out["others_p99_ratio"] = _ratio(
            out["head_retrying"]["others_p99_ms"], out["all_flowing"]["others_p99_ms"]
        )
        return out

    async def section_isolation(self) -> dict[str, Any]:
        """Each endpoint its own tenant (a customer each, so an event goes to one endpoint):
        the healthy ones alone, then beside the hanging ones, each getting its share of
        the same traffic (a burst, then a steady rate taking turns over every tenant)."""
        p = self.preset
        url = await self.database()
        healthy_tenants = [f"iso-{i}" for i in range(p.healthy)]
        healthy = await self.add_endpoints(
            url, healthy_tenants, [f"/latency/h-{i}" for i in range(p.healthy)]
        )
        await self.truncate(url)
        dispatcher = await self.dispatcher()
        out: dict[str, Any] = {"healthy_endpoints": p.healthy, "hanging_endpoints": p.hanging}
        deliveries = p.isolation_events * p.healthy
        try:
            out["alone"] = await self.burst(
                url,
                healthy_tenants,
                p.isolation_events,
                deliveries,
                dispatcher,
                rounds=ISOLATION_ROUNDS,
            )
            out["alone_latency"] = await self.steady(
                url, healthy_tenants, p.isolation_rate, p.isolation_seconds, 1
            )
            # All healthy: the same number of endpoints again in the hanging ones' place,
            # answering, each getting its share; the healthy ones' rate is what counts.
            spare_tenants = [f"iso-spare-{j}" for j in range(p.hanging)]
            await self.add_endpoints(
                url, spare_tenants, [f"/spare/s-{j}" for j in range(p.hanging)]
            )
            out["all_healthy"] = await self.burst(
                url,
                interleave(healthy_tenants, spare_tenants),
                p.isolation_events,
                deliveries,
                dispatcher,
                rounds=ISOLATION_ROUNDS,
            )
            await self.truncate(url)
            dead_tenants = [f"iso-dead-{j}" for j in range(p.hanging)]
            dead = await self.add_endpoints(
                url, dead_tenants, [f"/hang/dead-{j}" for j in range(p.hanging)]
            )
            every = interleave(healthy_tenants, dead_tenants)
            out["beside_dead"] = await self.burst(
                url, every, p.isolation_events, deliveries, dispatcher, rounds=ISOLATION_ROUNDS
            )
            hung = out["beside_dead"]["hung_all_rounds"]  # the steady run resets the counts
            out["dead_claims_last_round"] = await self.claims(url, dead)
            out["dead_backlog_before_latency_run"] = await self.pending(url, dead)
            out["beside_dead_latency"] = await self.steady(
                url,
                every,
                p.isolation_rate,
                p.isolation_seconds,
                1,
                answering=set(healthy_tenants),
            )
            out["dead_backlog_after_latency_run"] = await self.pending(url, dead)
            out["dead_requests_seen"] = hung + (await self.stats())["hung"]
            out["healthy_left_pending"] = await self.pending(url, healthy)
        finally:
            # Its hanging requests and the dead endpoint's retries end with it.
            await self.stop_dispatcher()
        # Against the all-healthy run (the bound), and against the healthy ones alone
        # (no traffic at all for the others: a stricter comparison).
        out["throughput_ratio"] = _ratio(out["beside_dead"]["rate"], out["all_healthy"]["rate"])
        out["throughput_ratio_alone"] = _ratio(out["beside_dead"]["rate"], out["alone"]["rate"])
        self.log(
            "isolation: healthy {a:,.0f}/s alone, {h:,.0f}/s all healthy, {b:,.0f}/s beside"
            " {n} hanging; p99 {c:.1f} -> {d:.1f} ms".format(
                a=out["alone"]["rate"],
                h=out["all_healthy"]["rate"],
                b=out["beside_dead"]["rate"],
                n=p.hanging,
                c=out["alone_latency"]["p99_ms"],
                d=out["beside_dead_latency"]["p99_ms"],
            )
        )
        return out

    async def section_burst(self) -> dict[str, Any]:
        """Cross-tenant head-of-line blocking: tenant B's steady events (each its own
        transaction carrying its commit time) alone, then while tenant A's burst of
        ``burst_events`` (one transaction) drains to a fast endpoint of its own; B's
        commit-to-receipt latency in both, A's drain time (commit to its last receipt).

        B's endpoint is on an ``/ordered...`` path of the receiver (the endpoint itself is
        unordered, every event a stream of its own) for the receiver's two latency lists:
        events marked ``watch`` (committed after A's commit) are recorded apart from the
        others (committed before A's insert began, or while it was still open)."""
        p = self.preset
        url = await self.database()
        b_path, a_path = "/ordered/burst-b", "/burst/a"
        b_ids = await self.add_endpoints(url, "burst-b", [b_path])
        a_ids = await self.add_endpoints(url, "burst-a", [a_path])
        await self.truncate(url)
        await self.dispatcher()
        out: dict[str, Any] = {
            "a_events": p.burst_events,
            "b_rate": p.burst_rate,
            "analyze_after_commit": p.burst_analyze,
        }

        async def outbox_scans() -> dict[str, Any]:
            """The outbox's scans so far, and whether autovacuum (its ANALYZE) is on: right
            after a bulk insert the planner's statistics may not know the new rows yet."""
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
                await c.execute("SELECT pg_stat_clear_snapshot()")
                cur = await c.execute(
                    "SELECT seq_scan, seq_tup_read, idx_scan, current_setting('autovacuum'),"
                    " last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL"
                    " FROM pg_stat_user_tables WHERE relid = 'webhook_outbox'::regclass"
                )
                row = await cur.fetchone()
                assert row is not None
                keys = ("seq_scan", "seq_tup_read", "idx_scan", "autovacuum", "analyzed")
                return dict(zip(keys, row, strict=True))

        async def wait_path(path: str, n: int, timeout: float) -> dict[str, Any]:
            deadline = time.monotonic() + timeout
            while True:
                stats = await self.stats()
                if stats["paths"].get(path, 0) >= n:
                    return stats
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{path}: {stats['paths'].get(path, 0)} of {n} receipts")
                await asyncio.sleep(0.02)

        # Warm-up: one event each, so both endpoints have their connections.
        await self.reset()
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            for tenant in ("burst-a", "burst-b"):
                await conn.execute(
                    "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                    " VALUES (%s, 'warm', 'bench.event', '{\"stream\": \"warm\", \"seq\": 0}')",
                    (tenant,),
                )
        await wait_path(a_path, 1, 30)
        await wait_path(b_path, 1, 30)

        state = {"watch": False, "stop": False, "sent": 0}

        async def produce(seconds: float | None) -> None:
            """B's steady events, until ``seconds`` or ``state["stop"]``."""
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await conn.execute("SELECT 1")
                start = time.perf_counter() + 0.05
                i = 0
                while not state["stop"]:
                    if seconds is not None and i >= int(p.burst_rate * seconds):
                        return
                    delay = start + i / p.burst_rate - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                        if state["stop"]:
                            return
                    watch = bool(state["watch"])
                    seq = state["sent"]
                    event = {"stream": f"b-{seq}", "seq": seq, "t0": time.time()}
                    if watch:
                        event["watch"] = True
                    await conn.execute(
                        "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload)"
                        " VALUES ('burst-b', %s, 'bench.latency', %s::jsonb)",
                        (f"b-{seq}", json.dumps(event)),
                    )
                    state["sent"] += 1
                    i += 1

        def summary(values: list[float]) -> dict[str, Any]:
            lat = sorted(values)
            return {
                "events": len(lat),
                "p50_ms": percentile(lat, 50),
                "p99_ms": percentile(lat, 99),
                "max_ms": lat[-1] if lat else float("nan"),
            }

        # (a) B alone.
        await self.reset()
        await produce(p.burst_alone_seconds)
        stats = await wait_path(b_path, state["sent"], 60)
        out["b_alone"] = summary(stats["latencies_ms"])
        self.log(
            "burst: B alone p50 {p50_ms:.2f} ms, p99 {p99_ms:.2f} ms, max {max_ms:.1f} ms".format(
                **out["b_alone"]
            )
        )

        # (b) A's burst, B going on beside it.
        await self.reset()
        state["sent"] = 0
        scans_before = await outbox_scans()
        producer = asyncio.create_task(produce(None))
        try:
            began = time.time()
            await self.insert_events(url, "burst-a", p.burst_events)
            committed = time.time()
            state["watch"] = True
            if p.burst_analyze:
                async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
                    await c.execute("ANALYZE webhook_outbox")
            # Slow drains are what this measures: wait long (20 deliveries/s at worst).
            timeout = max(600.0, p.burst_events / 20)
            deadline = time.monotonic() + timeout
            while True:
                stats = await self.stats()
                if stats["paths"].get(a_path, 0) >= p.burst_events:
                    break
                if time.monotonic() > deadline or producer.done():
                    raise RuntimeError(
                        f"A's burst: {stats['paths'].get(a_path, 0)} of {p.burst_events}"
                        f" receipts in {timeout:.0f}s"
                    )
                await asyncio.sleep(0.02)
            # The last receipt seen up to this poll (A's last one, or a B receipt within
            # the poll's 20 ms after it).
            drained = stats["last"]
        finally:
            state["stop"] = True
            await producer
        stats = await wait_path(b_path, state["sent"], 300)
        await asyncio.sleep(1)  # table statistics are flushed about once a second
        scans_after = await outbox_scans()
        out["autovacuum"] = scans_after["autovacuum"]
        out["outbox_analyzed"] = scans_after["analyzed"]
        for key in ("seq_scan", "seq_tup_read", "idx_scan"):
            out[f"outbox_{key}_during"] = scans_after[key] - scans_before[key]
        drain_s = drained - committed
        out["a_insert_s"] = round(committed - began, 3)
        out["a_drain_s"] = round(drain_s, 3)
        out["a_rate"] = p.burst_events / drain_s if drain_s > 0 else float("nan")
        out["a_received"] = stats["paths"].get(a_path, 0)
        out["b_during"] = summary(stats["watched_ms"])
        out["b_during_insert"] = summary(stats["latencies_ms"])  # committed before A's commit
        out["b_sent"] = state["sent"]
        out["b_received"] = stats["paths"].get(b_path, 0)
        # B's deliveries as the database recorded them (processed_at, the batch's completion,
        # a little after the receipt), each against its commit time relative to A's commit:
        # when in A's drain B's events waited how long.
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT (payload->>'t0')::float8 - %s,"
                " EXTRACT(EPOCH FROM processed_at) - (payload->>'t0')::float8"
                " FROM webhook_outbox WHERE endpoint_id = ANY(%s) AND outcome = 'delivered'"
                " AND payload ? 't0' ORDER BY 1",
                (committed, b_ids),
            )
            timeline = [(float(a), float(b)) for a, b in await cur.fetchall()]
            out["b_timeline_s"] = [[round(a, 3), round(b, 3)] for a, b in timeline]
            # The first delivery of a B event committed after A's commit, from A's commit:
            # against A's last delivery, whether B got anything through A's backlog.
            after = [a + b for a, b in timeline if a >= 0]
            out["b_during_first_delivered_s"] = round(min(after), 3) if after else None
            cur = await conn.execute(
                "SELECT EXTRACT(EPOCH FROM min(processed_at)) - %s,"
                " EXTRACT(EPOCH FROM max(processed_at)) - %s, count(*)"
                " FROM webhook_outbox WHERE endpoint_id = ANY(%s) AND outcome = 'delivered'"
                " AND stream_id <> 'warm'",
                (committed, committed, a_ids),
            )
            row = await cur.fetchone()
            assert row is not None
            out["a_db_first_s"], out["a_db_last_s"], out["a_db_delivered"] = (
                float(row[0]) if row[0] is not None else None,
                float(row[1]) if row[1] is not None else None,
                int(row[2]),
            )
        self.log(
            "burst: A's {n:,} drained in {d:.2f} s ({r:,.0f}/s); B during it p50 {p50:.1f} ms,"
            " p99 {p99:.1f} ms, max {mx:.1f} ms".format(
                n=p.burst_events,
                d=drain_s,
                r=out["a_rate"],
                p50=out["b_during"]["p50_ms"],
                p99=out["b_during"]["p99_ms"],
                mx=out["b_during"]["max_ms"],
            )
        )
        return out

    # -- the run ---------------------------------------------------------------------

    async def sections(
        self,
        names: Sequence[str],
        *,
        receiver_url: str | None = None,
        receiver: Child | None = None,
    ) -> dict[str, Any]:
        """Run ``names`` (in SECTIONS order) against the given receiver, or one of our own;
        every database and key made here is removed at the end."""
        unknown = set(names) - set(SECTIONS)
        if unknown:
            raise SystemExit(f"unknown section(s): {', '.join(sorted(unknown))}")
        out: dict[str, Any] = {}
        try:
            if receiver_url is None:
                await self.start_receiver()
            else:
                self.receiver_url, self.receiver = receiver_url, receiver
            for name in SECTIONS:
                if name in names:
                    self.log(f"section {name}")
                    t0 = time.monotonic()
                    out[name] = await getattr(self, f"section_{name}")()
                    out[name]["seconds"] = round(time.monotonic() - t0, 1)
        finally:
            await self.stop_dispatcher()
            await self.cleanup()
        out["targets"] = targets(out)
        return out


def targets(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    raw = dig(out, "raw", "best", "rate")

    def check(value: float | None, bound: float, at_least: bool) -> dict[str, Any]:
        if value is not None and value != value:
            value = None
        met = None if value is None else (value >= bound if at_least else value < bound)
        return {"value": value, "bound": bound, "met": met}

    return {
        "fan-out x100 / raw HTTP": check(
            _ratio(dig(out, "fanout", "best", "rate"), raw), FANOUT_RAW_MIN, True
        ),
        "fan-out x10 latency p50 (ms)": check(
            dig(out, "fanout_latency", "p50_ms"), LATENCY_P50_MAX_MS, False
        ),
        "fan-out x10 latency p99 (ms)": check(
            dig(out, "fanout_latency", "p99_ms"), LATENCY_P99_MAX_MS, False
        ),
        "ordered / unordered": check(dig(out, "ordered", "ratio"), ORDERED_RATIO_MIN, True),
        "healthy beside hanging endpoints / all-healthy run": check(
            dig(out, "isolation", "throughput_ratio"), ISOLATION_RATIO_MIN, True
        ),
        "healthy p99 beside a hanging endpoint (ms)": check(
            dig(out, "isolation", "beside_dead_latency", "p99_ms"), ISOLATION_P99_MAX_MS, False
        ),
    }


def _n(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:,.{digits}f}"


def _fastest(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of bursts of one kind (other load on a shared machine only ever slows a
    burst down), with every burst's rate (``all_rates``)."""
    best = dict(max(runs, key=lambda r: r["rate"] if r["rate"] == r["rate"] else 0.0))
    best["all_rates"] = [round(r["rate"], 1) for r in runs]
    return best


def render_table(out: dict[str, Any]) -> str:
    """One Markdown table: every measurement, with its ratio to the raw limit."""
    raw = dig(out, "raw", "best", "rate")
    rows: list[tuple[str, str, str, str]] = []

    def vs_raw(rate: float | None) -> str:
        r = _ratio(rate, raw)
        return "-" if r is None else f"{r:.2f}"

    for r in dig(out, "raw", "runs") or []:
        procs = r.get("processes", 1)
        rows.append(
            (
                f"raw HTTP, {procs} client process{'es' if procs > 1 else ''} x"
                f" {r['concurrency']} connections",
                f"{_n(r['rate'])} req/s",
                vs_raw(r["rate"]),
                "",
            )
        )
    for r in dig(out, "fanout", "runs") or []:
        rows.append(
            (
                f"fan-out x{r['endpoints']}, {r['label']}",
                f"{_n(r['rate'])} deliveries/s",
                vs_raw(r["rate"]),
                f"dispatcher {_n(r['dispatcher_cpu_us_per_delivery'])} us CPU/delivery",
            )
        )
    lat = out.get("fanout_latency")
    if lat:
        rows.append(
            (
                f"fan-out x{lat['endpoints']} at {lat['rate']} events/s, commit to receipt",
                f"p50 {_n(lat['p50_ms'], 2)} ms, p99 {_n(lat['p99_ms'], 2)} ms",
                "",
                f"max {_n(lat['max_ms'], 1)} ms, {lat['received']} receipts",
            )
        )
    ordered = out.get("ordered")
    if ordered:
        shape = f"{ordered['streams']} streams x {ordered['per_stream']}"
        for key, label in (("ord", "ordered"), ("unord", "unordered")):
            r = ordered.get(key)
            if r:
                note = ""
                if key == "ord":
                    ok = "in order" if ordered["in_order"] else "OUT OF ORDER"
                    note = f"{ok}: {r['out_of_order']} late, {r['repeats']} repeated"
                    ratio = ordered.get("ratio")
                    note += f"; {ratio:.2f} x unordered" if ratio else ""
                    rounds = [x for x in ordered.get("round_ratios", []) if x]
                    if len(rounds) > 1:
                        shown = ", ".join(f"{x:.2f}" for x in rounds)
                        note += f" (best of {len(rounds)} rounds each; round by round {shown})"
                rows.append(
                    (
                        f"{label} endpoint, {shape}",
                        f"{_n(r['rate'])} deliveries/s",
                        vs_raw(r["rate"]),
                        note,
                    )
                )
    head = out.get("ordered_head")
    if head:
        refused = f"one stream's head refused {head['head_refused_s']:g} s, retried"
        for key, label in (
            ("all_flowing", "every stream flowing"),
            ("head_retrying", refused),
            ("head_retrying_own_limit", f"{refused} (endpoint rate_limit {HEAD_RATE_LIMIT})"),
        ):
            r = head.get(key)
            if not r:
                continue
            note = f"{r['received']} receipts, {r['out_of_order']} out of order"
            if r.get("stuck_events"):
                note += (
                    f"; that stream's {r['stuck_events']} events: p50"
                    f" {_n(r['stuck_p50_ms'])} ms, max {_n(r['stuck_max_ms'])} ms"
                    f" ({r['refused']} refused)"
                )
            rows.append(
                (
                    f"ordered, {head['streams']} streams at {head['rate']} events/s, {label}",
                    f"other streams p50 {_n(r['others_p50_ms'], 2)} ms,"
                    f" p99 {_n(r['others_p99_ms'], 2)} ms",
                    "",
                    note,
                )
            )
    iso = out.get("isolation")
    if iso:
        n = iso["healthy_endpoints"]
        dead = iso.get("hanging_endpoints", 1)
        beside = "beside a hanging endpoint" if dead == 1 else f"beside {dead} hanging endpoints"
        spares = "healthy one" if dead == 1 else "healthy ones"
        for key, label in (
            ("alone", "alone"),
            ("all_healthy", f"beside {dead} {spares} (all healthy)"),
            ("beside_dead", beside),
        ):
            r = iso.get(key)
            if not r:
                continue
            note = ""
            if key == "beside_dead" and iso.get("throughput_ratio"):
                note = f"{iso['throughput_ratio']:.2f} x all healthy"
                if iso.get("throughput_ratio_alone"):
                    note += f", {iso['throughput_ratio_alone']:.2f} x alone"
            rows.append(
                (
                    f"{n} healthy endpoints, {label}",
                    f"{_n(r['rate'])} deliveries/s",
                    vs_raw(r["rate"]),
                    note,
                )
            )
        for key, label in (
            ("alone_latency", "alone"),
            ("beside_dead_latency", f"{beside}, with their backlog"),
        ):
            r = iso[key]
            note = ""
            if key == "beside_dead_latency":
                note = (
                    f"hanging endpoint's backlog {iso['dead_backlog_before_latency_run']}"
                    f" -> {iso['dead_backlog_after_latency_run']}"
                )
            rows.append(
                (
                    f"{n} healthy at {r['rate']} events/s, {label}",
                    f"p50 {_n(r['p50_ms'], 2)} ms, p99 {_n(r['p99_ms'], 2)} ms",
                    "",
                    note,
                )
            )
    burst = out.get("burst")
    if burst:
        b_label = f"tenant B at {burst['b_rate']} events/s"
        a_label = f"tenant A's {burst['a_events']:,} events in one transaction"
        for key, label in (
            ("b_alone", "alone"),
            ("b_during", f"beside {a_label}, from its commit until drained"),
            ("b_during_insert", f"beside {a_label}, committed while it was open"),
        ):
            r = burst[key]
            rows.append(
                (
                    f"{b_label}, {label}",
                    f"p50 {_n(r['p50_ms'], 2)} ms, p99 {_n(r['p99_ms'], 2)} ms",
                    "",
                    f"max {_n(r['max_ms'], 1)} ms, {r['events']} events",
                )
            )
        drained = f"drained in {_n(burst['a_drain_s'], 2)} s"
        drained += f" (its insert took {_n(burst['a_insert_s'], 2)} s)"
        if burst.get("analyze_after_commit"):
            drained += ", ANALYZE right after its commit"
        if "outbox_seq_scan_during" in burst:
            drained += (
                f"; {burst['outbox_seq_scan_during']:,} sequential scans of the outbox"
                f" ({burst['outbox_seq_tup_read_during']:,} rows), autovacuum"
                f" {burst['autovacuum']}"
            )
        if burst.get("b_during_first_delivered_s") is not None:
            drained += (
                f"; B's first event after A's commit delivered at"
                f" {_n(burst['b_during_first_delivered_s'], 2)} s, A's last at"
                f" {_n(burst['a_db_last_s'], 2)} s (database times)"
            )
        rows.append(
            (
                f"{a_label} to a fast endpoint, commit to last receipt",
                f"{_n(burst['a_rate'])} deliveries/s",
                vs_raw(burst["a_rate"]),
                drained,
            )
        )
    lines = ["| measurement | result | x raw | notes |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines += ["", "| target | measured | bound | met |", "|---|---|---|---|"]
    for name, t in (out.get("targets") or {}).items():
        met = {True: "yes", False: "NO", None: "-"}[t["met"]]
        lines.append(f"| {name} | {_n(t['value'], 2)} | {t['bound']} | {met} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/many.py",
        description="Fan-out, ordered streams and isolation against the raw HTTP limit.",
    )
    add_common_arguments(parser, SECTIONS)
    parser.add_argument(
        "--isolation",
        metavar="HEALTHY:HANGING",
        help="the isolation section's endpoints, e.g. 900:100 (the burst scaled to about"
        " 20,000 healthy deliveries)",
    )
    parser.add_argument(
        "--latency-rate",
        type=int,
        help="events/s of the fanout_latency section (the target is at 200; a slower"
        " machine that cannot keep up with that is compared at a rate it can)",
    )
    parser.add_argument(
        "--burst-events",
        type=int,
        help="the burst section's tenant A events (in one transaction)",
    )
    parser.add_argument(
        "--burst-analyze",
        action="store_true",
        help="the burst section: ANALYZE the outbox right after tenant A's commit",
    )
    parser.add_argument(
        "--db-prefix",
        default="bench_many_",
        help="the names of the databases made (and dropped) here start with this",
    )
    parser.add_argument(
        "--ports",
        metavar="LO-HI",
        help="take the receiver's and the dispatchers' metrics ports from this range",
    )
    return parser


def with_isolation(preset: Preset, shape: str | None) -> Preset:
    if not shape:
        return preset
    healthy, hanging = (int(x) for x in shape.split(":"))
    return dataclasses.replace(
        preset,
        healthy=healthy,
        hanging=hanging,
        isolation_events=max(1, 20_000 // healthy),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    preset = with_isolation(PRESETS[mode], args.isolation)
    if args.latency_rate:
        preset = dataclasses.replace(preset, latency_rate=args.latency_rate)
    if args.burst_events:
        preset = dataclasses.replace(preset, burst_events=args.burst_events)
    if args.burst_analyze:
        preset = dataclasses.replace(preset, burst_analyze=True)
    ports = None
    if args.ports:
        lo, _, hi = args.ports.partition("-")
        ports = (int(lo), int(hi or lo))
    bench = ManyBench(
        preset,
        admin_url=args.database_url or DEFAULT_PG,
        redis_url=args.redis_url or DEFAULT_REDIS,
        overrides=dict(item.split("=", 1) for item in args.set),
        db_prefix=args.db_prefix,
        ports=ports,
    )
    names = args.only.split(",") if args.only else list(SECTIONS)
    meta: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mode": mode,
        "preset": {k: v for k, v in vars(preset).items()},
        "dispatcher_env": bench.overrides,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "loadavg_at_start": list(os.getloadavg()),
    }

    async def go() -> dict[str, Any]:
        try:
            return await bench.sections(names)
        finally:
            await bench.children.stop_all()

    try:
        out = run(go())
    finally:
        shutil.rmtree(bench.tmp, ignore_errors=True)
    meta["loadavg_at_end"] = list(os.getloadavg())
    out = {"meta": meta, **out}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"many-{stamp}.json"
    out["meta"]["json"] = str(path)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(render_table(out))
    print(f"\nsaved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
