"""The benchmark: our dispatcher against the raw HTTP limit and a peer, in one run.

    fluxora-webhooks bench            # full run (about 10 minutes on 2 cores)
    fluxora-webhooks bench --quick    # smaller: fewer events, claim up to 1 M rows
    python benchmarks/run.py --help

Sections, each on the same machine and the same receiver:

- ``raw``: the HTTP limit, a plain aiohttp client (keep-alive, uvloop) blasting the
  receiver with the same body and header count; best of a few concurrencies.
- ``ours``: N events inserted with plain SQL in one transaction, delivered and marked by
  1, 2 and 4 ``fluxora-webhooks run`` processes (Redis gate on), and by 1 process with the
  gate off; rate from first to last receipt.
- ``pgqueuer``: the same N jobs, POSTed by a pgqueuer entrypoint with aiohttp; a few
  settings, the best is the peer's figure.
- ``latency``: commit-to-receipt at a steady rate, each event its own transaction carrying
  its commit time; default poll interval, so the LISTEN/NOTIFY wake-up is what is measured.
- ``claim``: the claim statement's time with 0, 1 M and 10 M processed rows in the table.
- ``gate``: what one Redis gate round trip (admit of a batch) costs.

It prints one table, saves ``benchmarks/results/<timestamp>.json`` and a PNG chart.
Databases it creates are named ``bench_*`` and dropped at the end; Redis keys carry a
prefix of their own and are deleted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    PAD,
    ahttp_json,
    body_bytes,
    free_port,
    percentile,
    run,
)
from plumbing import Plumbing, add_common_arguments, with_dbname
from procs import Child, Children, CpuMeter, RssSampler, process_tree
from report import render_chart, render_cpu_table, render_table, targets

HERE = Path(__file__).resolve().parent
SECRET = "bench-secret-0123456789abcdefghijklmnopqrstuvwxyz"
DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"

PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "events": 40_000,
        "raw_requests": 30_000,
        "raw_concurrency": [16, 64, 128],
        "processes": [1, 2, 4],
        "pgq_configs": ["10:1", "100:1", "100:2"],
        "latency_rate": 200,
        "latency_seconds": 10.0,
        "claim_rows": [0, 1_000_000, 10_000_000],
        "claim_samples": 400,
        "churn_rows": 1_000_000,
        "gate_samples": 2000,
        "repeat": 2,
        "tuned": "WEBHOOK_BATCH_SIZE=100",
        "celery_configs": ["prefork:2", "prefork:8"],
        "memory_backlogs": [100_000, 1_000_000],
        "memory_seconds": 10.0,
    },
    "quick": {
        "events": 15_000,
        "raw_requests": 15_000,
        "raw_concurrency": [64],
        "processes": [1, 2, 4],
        "pgq_configs": ["10:1", "100:1", "100:2"],
        "latency_rate": 200,
        "latency_seconds": 5.0,
        "claim_rows": [0, 1_000_000],
        "claim_samples": 200,
        "churn_rows": 100_000,
        "gate_samples": 500,
        "repeat": 1,
        "tuned": "WEBHOOK_BATCH_SIZE=100",
        "celery_configs": ["prefork:2", "prefork:8"],
        "memory_backlogs": [100_000, 1_000_000],
        "memory_seconds": 6.0,
    },
    # For the smoke test: every section, a few hundred events, seconds.
    "tiny": {
        "events": 300,
        "raw_requests": 300,
        "raw_concurrency": [16],
        "processes": [1, 2],
        "pgq_configs": ["10:1"],
        "latency_rate": 50,
        "latency_seconds": 1.0,
        "claim_rows": [0, 5_000],
        "claim_samples": 20,
        "churn_rows": 2_000,
        "gate_samples": 20,
        "repeat": 1,
        "tuned": "WEBHOOK_BATCH_SIZE=50",
        "celery_configs": ["prefork:2"],
        "memory_backlogs": [2_000],
        "memory_seconds": 1.0,
    },
}

SECTIONS = ("raw", "ours", "pgqueuer", "celery", "latency", "memory", "claim", "gate")


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fluxora-webhooks bench",
        description="Throughput and latency against the raw HTTP limit, pgqueuer and Celery.",
    )
    add_common_arguments(parser, SECTIONS)
    parser.add_argument("--events", type=int, help="events per throughput run")
    parser.add_argument("--processes", type=_ints, help="dispatcher processes, e.g. 1,2,4")
    parser.add_argument("--raw-concurrency", type=_ints, help="raw client concurrencies")
    parser.add_argument(
        "--pgq-configs", help="pgqueuer batch:processes[:max_tasks] list, e.g. 10:1,100:1"
    )
    parser.add_argument("--pgq-driver", choices=("auto", "asyncpg", "psycopg"), default="auto")
    parser.add_argument("--latency-rate", type=int, help="events/s of the latency run")
    parser.add_argument("--latency-seconds", type=float)
    parser.add_argument("--claim-rows", type=_ints, help="processed rows, e.g. 0,1000000")
    parser.add_argument("--churn-rows", type=int, help="rows updated to processed, not vacuumed")
    parser.add_argument(
        "--tuned",
        help="environment of the 'ours, tuned' run (default WEBHOOK_BATCH_SIZE=100; '' skips)",
    )
    parser.add_argument(
        "--celery-configs", help="Celery pool:concurrency list, e.g. prefork:2,threads:32"
    )
    parser.add_argument(
        "--memory-backlogs", type=_ints, help="pending rows of the memory runs, e.g. 100000"
    )
    parser.add_argument("--repeat", type=int, help="runs per throughput point; the best counts")
    parser.add_argument("--profile", action="store_true", help="py-spy the 1-process run")
    parser.add_argument("--no-chart", action="store_true")
    return parser


class Bench(Plumbing):
    def __init__(self, args: argparse.Namespace) -> None:
        preset = PRESETS["tiny" if args.tiny else "quick" if args.quick else "full"]
        self.mode = "tiny" if args.tiny else "quick" if args.quick else "full"
        self.events: int = args.events or preset["events"]
        self.raw_requests: int = args.events or preset["raw_requests"]
        self.raw_concurrency: list[int] = args.raw_concurrency or preset["raw_concurrency"]
        self.processes: list[int] = args.processes or preset["processes"]
        self.pgq_configs: list[str] = (
            args.pgq_configs.split(",") if args.pgq_configs else preset["pgq_configs"]
        )
        self.pgq_driver: str = args.pgq_driver
        self.latency_rate: int = args.latency_rate or preset["latency_rate"]
        self.latency_seconds: float = args.latency_seconds or preset["latency_seconds"]
        self.claim_rows: list[int] = (
            args.claim_rows if args.claim_rows is not None else preset["claim_rows"]
        )
        self.claim_samples: int = preset["claim_samples"]
        self.churn_rows: int = args.churn_rows or preset["churn_rows"]
        self.gate_samples: int = preset["gate_samples"]
        self.sections = set(args.only.split(",")) if args.only else set(SECTIONS)
        unknown = self.sections - set(SECTIONS)
        if unknown:
            raise SystemExit(f"unknown section(s): {', '.join(sorted(unknown))}")
        self.overrides = dict(item.split("=", 1) for item in args.set)
        self.profile: bool = args.profile
        self.repeat: int = args.repeat or preset["repeat"]
        tuned_text = args.tuned if args.tuned is not None else preset["tuned"]
        self.tuned = dict(item.split("=", 1) for item in tuned_text.split(",") if item.strip())
        self.celery_configs: list[str] = (
            args.celery_configs.split(",") if args.celery_configs else preset["celery_configs"]
        )
        self.memory_backlogs: list[int] = args.memory_backlogs or preset["memory_backlogs"]
        self.memory_seconds: float = preset["memory_seconds"]
        # The raw limit is the best of one client process and one per CPU (issue 16).
        self.raw_processes: list[int] = sorted({1, os.cpu_count() or 1})
        self.admin_url: str = args.database_url or DEFAULT_PG
        self.redis_url: str = args.redis_url or DEFAULT_REDIS
        self.results_dir: Path = args.results
        self.chart: bool = not args.no_chart
        self.run_id = uuid.uuid4().hex[:8]
        self.prefix = f"bench:{self.run_id}:"
        self.tmp = Path(tempfile.mkdtemp(prefix="fluxora-bench-"))
        self.children = Children(self.tmp)
        self.databases: list[str] = []
        self.receiver_url = ""
        self.out: dict[str, Any] = {}

    # -- plumbing --------------------------------------------------------------------

    def log(self, text: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    async def create_database(self, suffix: str) -> str:
        name = f"bench_{suffix}_{self.run_id}"
        async with await psycopg.AsyncConnection.connect(self.admin_url, autocommit=True) as c:
            await c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.databases.append(name)
        return with_dbname(self.admin_url, name)

    # -- the run ---------------------------------------------------------------------

    async def main(self) -> dict[str, Any]:
        started = time.time()
        self.out = {
            "meta": {
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "mode": self.mode,
                "events": self.events,
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                },
                "dispatcher_env": self.overrides,
                "loadavg_at_start": list(os.getloadavg()),
                "libraries": _libraries(),
                "body_bytes": len(body_bytes()),
            }
        }
        try:
            receiver = await self.children.script("receiver", "receiver.py", "--port", "0")
            port = int((await receiver.wait_for_line("PORT ", 15)).split()[1])
            self.receiver_url = f"http://127.0.0.1:{port}"
            self.receiver = receiver
            self.out["meta"]["postgres"] = await self.server_version()
            for section in SECTIONS:
                if section in self.sections:
                    self.log(f"section {section}")
                    t0 = time.monotonic()
                    self.out[section] = await getattr(self, f"section_{section}")()
                    self.out[section]["seconds"] = round(time.monotonic() - t0, 1)
        finally:
            await self.children.stop_all()
            with contextlib.suppress(Exception):
                await self.drop_databases()
            with contextlib.suppress(Exception):
                await self.drop_redis_keys()
        self.out["meta"]["seconds"] = round(time.time() - started, 1)
        self.out["meta"]["loadavg_at_end"] = list(os.getloadavg())
        self.out["targets"] = targets(self.out)
        return self.out

    async def server_version(self) -> str:
        async with await psycopg.AsyncConnection.connect(self.admin_url, autocommit=True) as c:
            cur = await c.execute("SHOW server_version")
            row = await cur.fetchone()
            return str(row[0]) if row else "?"

    # -- raw HTTP --------------------------------------------------------------------

    async def section_raw(self) -> dict[str, Any]:
        runs = []
        for procs in self.raw_processes:
            for conc in self.raw_concurrency:
                runs.append(
                    await self.best_of(
                        f"raw {procs}x c={conc}",
                        lambda i, c=conc, n=procs: self.raw_run(c, n, self.raw_requests),
                    )
                )
        best = max(runs, key=lambda r: r["rate"])
        return {"runs": runs, "best": best}

    # -- our dispatcher --------------------------------------------------------------

    async def ours_database(self) -> str:
        if not hasattr(self, "_ours_db"):
            self._ours_db = await self.create_database("ours")
        # Every time, with the command itself: the code on disk is what the dispatcher
        # processes will run, and it may be newer than this process's imports.
        await self.migrate(self._ours_db)
        return self._ours_db

    def dispatcher_env(
        self,
        database_url: str,
        path: str,
        metrics_port: int,
        extra: dict[str, str] | None = None,
        *,
        default_workers: bool = False,
    ) -> dict[str, str]:
        keep = ("DATABASE_URL", "REDIS_URL", "WEBHOOK_", "LOG_FORMAT", "FLUXORA_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(keep)}
        env.update(
            {
                "DATABASE_URL": database_url,
                "REDIS_URL": self.redis_url,
                "WEBHOOK_URL": self.receiver_url + path,
                "WEBHOOK_SECRET": SECRET,
                "WEBHOOK_METRICS_PORT": str(metrics_port),
                "FLUXORA_REDIS_PREFIX": self.prefix,
                "FLUXORA_HOME": str(self.tmp / "home"),
                # "N processes" means N single-process runs (--set WEBHOOK_WORKERS=... to
                # measure the supervisor).
                "WEBHOOK_WORKERS": "1",
            }
        )
        if default_workers:
            # One `run` as a user starts it: WEBHOOK_WORKERS left at its default.
            del env["WEBHOOK_WORKERS"]
        env.update(self.overrides)
        env.update(extra or {})
        return env

    async def start_dispatchers(
        self,
        count: int,
        database_url: str,
        path: str,
        *,
        gate: bool = True,
        tag: str = "",
        extra: dict[str, str] | None = None,
        default_workers: bool = False,
    ) -> list[Child]:
        procs: list[tuple[Child, int]] = []
        for i in range(count):
            port = free_port()
            env = self.dispatcher_env(
                database_url, path, port, extra, default_workers=default_workers
            )
            argv = (
                [sys.executable, "-m", "fluxora_webhooks", "run"]
                if gate
                else [sys.executable, str(HERE / "service_nogate.py")]
            )
            child = await self.children.spawn(f"dispatcher{tag}-{count}p-{i}", argv, env)
            procs.append((child, port))
        for child, port in procs:
            await self.wait_ready(child, port)
        if default_workers:
            await self.wait_workers([c for c, _ in procs], os.cpu_count() or 1)
        await asyncio.sleep(0.5)  # claim loops connect after /readyz answers
        return [c for c, _ in procs]

    async def wait_ready(self, child: Child, port: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if child.proc.returncode is not None:
                break
            with contextlib.suppress(Exception):
                await ahttp_json(f"http://127.0.0.1:{port}/readyz", timeout=1)
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{child.name} did not become ready:\n{child.log()[-3000:]}")

    async def insert_events(self, database_url: str, n: int) -> None:
        """N events in one transaction, by plain SQL (as a producer in any language would)."""
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await c.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                " SELECT 'stream-' || g, 'bench.event',"
                " jsonb_build_object('kind', 'bench', 'seq', g, 'pad', %(pad)s::text)"
                " FROM generate_series(1, %(n)s) g",
                {"n": n, "pad": PAD},
            )

    async def pending(self, database_url: str) -> int:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            cur = await c.execute("SELECT count(*) FROM webhook_outbox WHERE NOT processed")
            row = await cur.fetchone()
            return int(row[0]) if row else -1

    async def one_dispatch_run(
        self,
        processes: int,
        *,
        gate: bool = True,
        profile: bool = False,
        extra: dict[str, str] | None = None,
        default_workers: bool = False,
    ) -> dict[str, Any]:
        database_url = await self.ours_database()
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await c.execute("TRUNCATE webhook_outbox, webhook_dead_letter")
            await c.execute("VACUUM ANALYZE webhook_outbox")
        tag = ("" if gate else "-nogate") + ("-tuned" if extra else "")
        tag += "-defaultworkers" if default_workers else ""
        procs = await self.start_dispatchers(
            processes,
            database_url,
            "/ours",
            gate=gate,
            tag=tag,
            extra=extra,
            default_workers=default_workers,
        )
        await self.reset()
        pids = [pid for p in procs for pid in process_tree(p.pid)]
        meter = CpuMeter({"dispatchers": pids, "receiver": [self.receiver.pid]})
        rss = RssSampler(pids)
        rss.start()
        spy = None
        n = self.events
        timeout = max(60.0, n / 300)
        try:
            meter.start()
            if profile:
                spy = await self.start_profiler(procs[0], tag=f"{processes}p{tag}")
            await self.insert_events(database_url, n)
            stats = await self.wait_count(n, timeout)
            cpu = meter.stop()
            left = await self.wait_drained(database_url, 30)
            drained_at = time.time()
        finally:
            memory = await rss.stop()
            if spy is not None:
                await spy.stop(60, signal.SIGINT)  # py-spy writes its file on SIGINT
            codes = [await p.stop() for p in procs]
        stats = await self.stats()
        rate = self.rate(stats)
        result = {
            "processes": processes,
            "default_workers": default_workers,
            "os_processes": len(pids),
            "memory": memory,
            "gate": gate,
            "env": {**self.overrides, **(extra or {})},
            "events": n,
            "rate": rate,
            "received": stats["count"],
            "duplicates": stats["count"] - n,
            "marked_after_last_receipt_s": round(drained_at - stats["last"], 3),
            "left_pending": left,
            # Dispatcher CPU per delivered event: the cost that decides how far one core goes.
            "dispatcher_cpu_us_per_event": round(10_000 * cpu.get("dispatchers", 0) / rate, 1)
            if rate == rate and rate > 0
            else None,
            "exit_codes": codes,
            "cpu_pct": cpu,
        }
        if spy is not None:
            result["profile"] = str(self.profile_path(f"{processes}p{tag}"))
        self.log(
            f"ours {processes}p{'' if gate else ' (gate off)'}: {rate:,.0f} events/s, cpu {cpu}"
        )
        return result

    async def wait_drained(self, database_url: str, timeout: float) -> int:
        """Wait until every row is marked processed; the rows still pending at the end."""
        deadline = time.monotonic() + timeout
        left = await self.pending(database_url)
        while left and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            left = await self.pending(database_url)
        return left

    def profile_path(self, tag: str) -> Path:
        return self.results_dir / f"profile-{self.run_id}-{tag}.txt"

    async def start_profiler(self, child: Child, tag: str) -> Child | None:
        py_spy = find_py_spy()
        if py_spy is None:
            self.log("py-spy not installed: no profile (pip install py-spy)")
            return None
        self.results_dir.mkdir(parents=True, exist_ok=True)
        spy = await self.children.spawn(
            f"py-spy-{tag}",
            [
                py_spy,
                "record",
                "--pid",
                str(child.pid),
                "--format",
                "raw",
                "--rate",
                "250",
                "--nonblocking",
                "--output",
                str(self.profile_path(tag)),
            ],
        )
        await asyncio.sleep(0.5)
        return spy

    async def best_of(self, what: str, run_once: Any) -> dict[str, Any]:
        """Run a measurement ``self.repeat`` times and keep the fastest: other load on the
        machine only ever slows a run down, so the best run is the least disturbed one."""
        runs = []
        for i in range(self.repeat):
            runs.append(await run_once(i))
        best = dict(max(runs, key=lambda r: r["rate"]))
        best["all_rates"] = [round(r["rate"], 1) for r in runs]
        if self.repeat > 1:
            self.log(f"{what}: best of {self.repeat}: {best['rate']:,.0f}/s")
        return best

    async def section_ours(self) -> dict[str, Any]:
        runs = []
        for count in self.processes:
            runs.append(
                await self.best_of(
                    f"ours {count}p",
                    lambda i, c=count: self.one_dispatch_run(
                        c, profile=self.profile and c == 1 and i == 0
                    ),
                )
            )
        nogate = await self.best_of(
            "ours 1p gate off",
            lambda i: self.one_dispatch_run(1, gate=False, profile=self.profile and i == 0),
        )
        out: dict[str, Any] = {"runs": runs, "gate_off_1p": nogate}
        out["best"] = max(runs, key=lambda r: r["rate"])
        # What a user who starts one `fluxora-webhooks run` gets: every default (the
        # supervisor and its default workers), then the same with batch 100.
        out["defaults"] = await self.best_of(
            "ours, one run, defaults",
            lambda i: self.one_dispatch_run(1, default_workers=True),
        )
        if self.tuned:
            out["tuned"] = await self.best_of(
                "ours, one run, tuned",
                lambda i: self.one_dispatch_run(1, extra=self.tuned, default_workers=True),
            )
        return out

    # -- the peer --------------------------------------------------------------------

    def pgq_driver_name(self) -> str:
        if self.pgq_driver != "auto":
            return self.pgq_driver
        try:
            import asyncpg  # noqa: F401
        except ImportError:
            return "psycopg"
        return "asyncpg"

    async def section_pgqueuer(self) -> dict[str, Any]:
        try:
            from pgqueuer.db import PsycopgDriver
            from pgqueuer.queries import Queries
        except ImportError:
            return {"skipped": "pgqueuer is not installed (pip install -e '.[bench]')"}
        url = await self.create_database("pgq")
        driver = self.pgq_driver_name()
        if driver == "psycopg" and self.pgq_driver == "auto":
            self.log(
                "asyncpg is not installed: pgqueuer runs on its psycopg driver, far below its"
                " best (pip install asyncpg)"
            )
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        try:
            queries = Queries(PsycopgDriver(conn))
            await queries.install()
            runs = []
            for config in self.pgq_configs:
                runs.append(
                    await self.best_of(
                        f"pgqueuer {config}",
                        lambda i, c=config: self.pgq_run(queries, url, driver, c),
                    )
                )
        finally:
            await conn.close()
        best = max(runs, key=lambda r: r["rate"])
        from pgqueuer import __version__ as pgq_version

        return {"version": pgq_version, "runs": runs, "best": best}

    async def pgq_run(self, queries: Any, url: str, driver: str, config: str) -> dict[str, Any]:
        parts = [int(x) for x in config.split(":")]
        batch, count = parts[0], parts[1]
        max_tasks = parts[2] if len(parts) > 2 else 0
        await queries.clear_queue()
        await queries.clear_queue_log()
        await queries.clear_statistics_log()
        workers = []
        for i in range(count):
            child = await self.children.script(
                f"pgq-b{batch}-{count}p-{i}",
                "pgq_worker.py",
                "--dsn",
                url,
                "--url",
                self.receiver_url + "/pgq",
                "--batch",
                str(batch),
                "--driver",
                driver,
                "--max-tasks",
                str(max_tasks),
            )
            workers.append(child)
        for child in workers:
            await child.wait_for_line("READY", 30)
        await asyncio.sleep(1.0)  # past verify_structure and LISTEN
        await self.reset()
        meter = CpuMeter({"workers": [w.pid for w in workers], "receiver": [self.receiver.pid]})
        meter.start()
        n = self.events
        try:
            payloads: list[bytes | None] = [body_bytes(i) for i in range(n)]
            await queries.enqueue(["webhook"] * n, payloads, [0] * n)
            stats = await self.wait_count(n, max(60.0, n / 300))
            cpu = meter.stop()
        finally:
            for child in workers:
                await child.stop()
        rate = self.rate(stats)
        self.log(f"pgqueuer batch {batch} x{count} ({driver}): {rate:,.0f} jobs/s")
        return _peer_result(
            rate, stats, cpu, batch=batch, processes=count, max_tasks=max_tasks, driver=driver
        )

    # -- the second peer: Celery ----------------------------------------------------

    async def section_celery(self) -> dict[str, Any]:
        try:
            import celery
        except ImportError:
            return {"skipped": "celery is not installed (pip install -e '.[bench]')"}
        runs = []
        for config in self.celery_configs:
            runs.append(
                await self.best_of(f"celery {config}", lambda i, c=config: self.celery_run(c))
            )
        best = max(runs, key=lambda r: r["rate"])
        return {"version": celery.__version__, "runs": runs, "best": best}

    def celery_env(self, queue: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "PYTHONPATH": str(HERE),
                "BENCH_CELERY_BROKER": self.redis_url,
                "BENCH_CELERY_QUEUE": queue,
                "BENCH_CELERY_URL": self.receiver_url + "/celery",
                "BENCH_CELERY_ACKS_LATE": "1",
            }
        )
        return env

    async def celery_run(self, config: str) -> dict[str, Any]:
        """N tasks sent first, then one worker with ``pool:concurrency`` drains them."""
        pool, concurrency = config.split(":")
        queue = f"{self.prefix}celery:{config}"
        env = self.celery_env(queue)
        n = self.events
        sender = await self.children.spawn(
            f"celery-send-{pool}{concurrency}",
            [sys.executable, str(HERE / "celery_peer.py"), "--send", str(n)],
            env,
        )
        if await asyncio.wait_for(sender.proc.wait(), 300) != 0:
            raise RuntimeError(f"sending Celery tasks failed:\n{sender.log()[-3000:]}")
        await self.reset()
        worker = await self.children.spawn(
            f"celery-{pool}{concurrency}",
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "celery_peer",
                "worker",
                f"--pool={pool}",
                f"--concurrency={concurrency}",
                "--loglevel=WARNING",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-Q",
                queue,
            ],
            env,
        )
        meter: CpuMeter | None = None
        try:
            # The meter starts once the pool's processes exist; the receiver's first and
            # last receipt give the rate either way.
            deadline = time.monotonic() + 30
            while pool == "prefork" and len(process_tree(worker.pid)) <= int(concurrency):
                if time.monotonic() > deadline or worker.proc.returncode is not None:
                    raise RuntimeError(f"the Celery worker did not start:\n{worker.log()[-3000:]}")
                await asyncio.sleep(0.05)
            meter = CpuMeter({"workers": process_tree(worker.pid), "receiver": [self.receiver.pid]})
            meter.start()
            incomplete = False
            try:
                stats = await self.wait_count(n, max(120.0, n / 100))
            except RuntimeError as exc:  # too slow to finish: its rate so far is its figure
                self.log(f"celery {config}: {exc}")
                stats, incomplete = await self.stats(), True
            cpu = meter.stop()
        finally:
            await worker.stop(30)
            from redis.asyncio import Redis

            client = Redis.from_url(self.redis_url)
            try:
                await client.delete(queue, f"{queue}\x06\x163", f"{queue}\x06\x166")
            finally:
                await client.aclose()
        rate = self.rate(stats)
        self.log(f"celery {pool} x{concurrency}: {rate:,.0f} tasks/s")
        return _peer_result(
            rate,
            stats,
            cpu,
            pool=pool,
            concurrency=int(concurrency),
            acks_late=True,
            incomplete=incomplete,
        )

    # -- memory with a backlog ----------------------------------------------------------

    async def section_memory(self) -> dict[str, Any]:
        """Resident memory of one default `run` while a backlog of N rows drains."""
        points = []
        for backlog in self.memory_backlogs:
            points.append(await self.memory_run(backlog))
        return {"points": points}

    async def memory_run(self, backlog: int) -> dict[str, Any]:
        database_url = await self.ours_database()
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await c.execute("TRUNCATE webhook_outbox, webhook_dead_letter")
        await self.insert_events(database_url, backlog)
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await c.execute("VACUUM ANALYZE webhook_outbox")
        await self.reset()
        procs = await self.start_dispatchers(
            1, database_url, "/memory", tag=f"-memory{backlog}", default_workers=True
        )
        pids = process_tree(procs[0].pid)
        rss = RssSampler(pids)
        rss.start()
        try:
            await asyncio.sleep(self.memory_seconds)
        finally:
            memory = await rss.stop()
            await procs[0].stop()
        stats = await self.stats()
        self.log(
            f"memory with {backlog:,} pending: peak {memory.get('peak_mb')} MB per process,"
            f" {stats['count']:,} delivered meanwhile"
        )
        return {
            "backlog": backlog,
            "seconds": self.memory_seconds,
            "delivered": stats["count"],
            "rate": self.rate(stats),
            "memory": memory,
        }

    # -- latency ---------------------------------------------------------------------

    async def section_latency(self) -> dict[str, Any]:
        database_url = await self.ours_database()
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await c.execute("TRUNCATE webhook_outbox, webhook_dead_letter")
        # The default poll interval: a wake-up that is not LISTEN/NOTIFY would show as
        # seconds. The caller's --set overrides still apply (to compare settings).
        procs = await self.start_dispatchers(1, database_url, "/latency", tag="-latency")
        await self.reset()
        rate, seconds = self.latency_rate, self.latency_seconds
        total = int(rate * seconds)
        commit_ms: list[float] = []
        try:
            async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
                await conn.execute("SELECT 1")
                start = time.perf_counter() + 0.1
                for i in range(total):
                    # Absolute schedule: a slow commit does not delay the ones after it.
                    delay = start + i / rate - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    t0 = time.time()
                    await conn.execute(
                        "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                        " VALUES (%s, 'bench.latency',"
                        " jsonb_build_object('kind', 'latency', 'seq', %s::int,"
                        " 't0', %s::float8))",
                        (f"lat-{i}", i, t0),
                    )
                    commit_ms.append((time.time() - t0) * 1000)
            stats = await self.wait_count(total, 30)
        finally:
            for p in procs:
                await p.stop()
        lat = sorted(stats["latencies_ms"])
        commits = sorted(commit_ms)
        result = {
            "rate": rate,
            "seconds": seconds,
            "events": total,
            "received": stats["count"],
            "p50_ms": percentile(lat, 50),
            "p95_ms": percentile(lat, 95),
            "p99_ms": percentile(lat, 99),
            "max_ms": lat[-1] if lat else float("nan"),
            "commit_p50_ms": percentile(commits, 50),
            "commit_p99_ms": percentile(commits, 99),
            "histogram_ms": _histogram(lat),
            "poll_interval_ms": int(self.overrides.get("WEBHOOK_POLL_INTERVAL_MS", "10000")),
        }
        self.log(
            "latency p50 {p50_ms:.2f} ms, p95 {p95_ms:.2f} ms, p99 {p99_ms:.2f} ms".format(**result)
        )
        return result

    # -- claim with processed rows ---------------------------------------------------

    async def section_claim(self) -> dict[str, Any]:
        url = await self.create_database("claim")
        await self.migrate(url)
        points = []
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute("SET synchronous_commit = off")
            await conn.execute("SET maintenance_work_mem = '512MB'")
            # Rows pending now, behind every processed one in (created_at, id) order.
            await conn.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                " SELECT 'pending-' || g, 'bench.claim', '{\"kind\": \"pending\"}'"
                " FROM generate_series(1, 1000) g"
            )
            have = 0
            for target in sorted(self.claim_rows):
                t_load = time.monotonic()
                while have < target:
                    step = min(1_000_000, target - have)
                    await conn.execute(
                        "INSERT INTO webhook_outbox (stream_id, event_type, payload,"
                        " created_at, processed, delivery_id, enqueued_at, processed_at,"
                        " outcome, status_code, duration_ms)"
                        " SELECT 'old-' || (g %% 1000), 'bench.old', '{\"kind\": \"old\"}',"
                        " ts, true,"
                        " ('00000000-0000-4000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,"
                        " ts, ts, 'delivered', 200, 1.0"
                        " FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) g,"
                        " LATERAL (SELECT timestamptz '2024-01-01' + g * interval '1 ms') t(ts)",
                        {"lo": have + 1, "hi": have + step},
                    )
                    have += step
                    self.log(f"claim: {have:,} processed rows loaded")
                await conn.execute("VACUUM ANALYZE webhook_outbox")
                point = await self.measure_claims(conn)
                point.update(processed_rows=target, load_s=round(time.monotonic() - t_load, 1))
                points.append(point)
                self.log(f"claim with {target:,} processed rows: p50 {point['p50_ms']:.3f} ms")
            churn = await self.claim_after_churn(conn)
        return {"points": points, "churn": churn}

    async def measure_claims(self, conn: psycopg.AsyncConnection[Any]) -> dict[str, Any]:
        """The claim statement as the dispatcher runs it (prepared, in its transaction)."""
        from fluxora_webhooks.outbox import claim_due

        samples = []
        for _ in range(self.claim_samples):
            async with conn.transaction(force_rollback=True):
                t0 = time.perf_counter()
                rows = await claim_due(conn, 10)
                samples.append((time.perf_counter() - t0) * 1000)
            assert len(rows) == 10
        cur = await conn.execute(
            "EXPLAIN (FORMAT JSON) SELECT id FROM webhook_outbox"
            " WHERE processed = false AND created_at <= now()"
            " ORDER BY created_at, id LIMIT 10 FOR UPDATE SKIP LOCKED"
        )
        plan_row = await cur.fetchone()
        first = samples[0]
        samples.sort()
        return {
            "p50_ms": percentile(samples, 50),
            "p95_ms": percentile(samples, 95),
            "first_ms": first,
            "mean_ms": sum(samples) / len(samples),
            "samples": len(samples),
            "uses_index": "webhook_outbox_due_idx" in json.dumps(plan_row),
        }

    async def claim_after_churn(self, conn: psycopg.AsyncConnection[Any]) -> dict[str, Any]:
        """Rows marked processed by UPDATE (as the dispatcher does) and not vacuumed yet:
        their old versions still sit at the head of the partial index until a scan marks
        them dead or VACUUM removes them. ``first_ms`` is the claim that walks past them."""
        rows = self.churn_rows
        await conn.execute("ALTER TABLE webhook_outbox SET (autovacuum_enabled = false)")
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, created_at)"
            " SELECT 'churn-' || g, 'bench.churn', '{\"kind\": \"churn\"}',"
            " now() - interval '1 hour' + g * interval '1 us'"
            " FROM generate_series(1, %(n)s) g",
            {"n": rows},
        )
        await conn.execute(
            "UPDATE webhook_outbox SET processed = true, processed_at = now(),"
            " outcome = 'delivered', status_code = 200"
            " WHERE NOT processed AND event_type = 'bench.churn'"
        )
        point = await self.measure_claims(conn)
        point["updated_rows_not_vacuumed"] = rows
        await conn.execute("ALTER TABLE webhook_outbox RESET (autovacuum_enabled)")
        await conn.execute("VACUUM webhook_outbox")
        after = await self.measure_claims(conn)
        point["after_vacuum_p50_ms"] = after["p50_ms"]
        point["after_vacuum_first_ms"] = after["first_ms"]
        self.log(
            f"claim after {rows:,} rows processed and not vacuumed: first "
            f"{point['first_ms']:.2f} ms, p50 {point['p50_ms']:.3f} ms; after VACUUM p50 "
            f"{point['after_vacuum_p50_ms']:.3f} ms"
        )
        return point

    # -- the Redis gate --------------------------------------------------------------

    async def section_gate(self) -> dict[str, Any]:
        from fluxora_webhooks.redis_gate import connect_gate

        gate = await connect_gate(
            self.redis_url,
            retry_rps=10,
            breaker_threshold=0,
            breaker_reset_ms=300_000,
            probe_ttl_ms=20_000,
            prefix=self.prefix,
        )
        url = self.receiver_url + "/gate"
        out: dict[str, Any] = {}
        try:
            for label, threshold in (("admit, breaker off", 0), ("admit+report, breaker on", 5)):
                gate.breaker_threshold = threshold
                samples = []
                for _ in range(self.gate_samples):
                    t0 = time.perf_counter()
                    admissions = await gate.admit(url, [1] * 10)
                    await gate.report(url, [(a, True) for a in admissions])
                    samples.append((time.perf_counter() - t0) * 1000)
                samples.sort()
                out[label] = {
                    "p50_ms": percentile(samples, 50),
                    "p99_ms": percentile(samples, 99),
                    "batch": 10,
                }
        finally:
            await gate.close()
        self.log(f"gate: {out}")
        return {"per_batch": out}


def _peer_result(
    rate: float, stats: dict[str, Any], cpu: dict[str, float], **config: Any
) -> dict[str, Any]:
    """A peer's run: its configuration, rate, receipts, CPU shares and worker CPU per event."""
    return {
        **config,
        "rate": rate,
        "received": stats["count"],
        "cpu_pct": cpu,
        "worker_cpu_us_per_event": round(10_000 * cpu.get("workers", 0) / rate, 1)
        if rate > 0
        else None,
    }


def _libraries() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in (
        "aiohttp",
        "psycopg",
        "psycopg-binary",
        "redis",
        "hiredis",
        "uvloop",
        "pgqueuer",
        "asyncpg",
    ):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def find_py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def _histogram(values: Sequence[float]) -> list[list[float]]:
    edges = [0.5, 1, 1.5, 2, 3, 4, 5, 7.5, 10, 15, 25, 50, 100, 1000, 1e9]  # 1e9: the rest
    counts = [0] * len(edges)
    for v in values:
        for i, edge in enumerate(edges):
            if v <= edge:
                counts[i] += 1
                break
    return [[e, c] for e, c in zip(edges, counts, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bench = Bench(args)
    try:
        out = run(bench.main())
    finally:
        shutil.rmtree(bench.tmp, ignore_errors=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    bench.results_dir.mkdir(parents=True, exist_ok=True)
    json_path = bench.results_dir / f"{stamp}.json"
    out["meta"]["json"] = str(json_path)
    if bench.chart:
        png = bench.results_dir / f"{stamp}.png"
        render_chart(out, png)
        out["meta"]["chart"] = str(png)
    json_path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(render_table(out))
    print("\nCPU per delivery, microseconds (sender: the raw client, our dispatchers or pgqueuer):")
    print(render_cpu_table(out))
    print(f"\nsaved {json_path}" + (f" and {out['meta']['chart']}" if bench.chart else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
