"""The soak: a long randomized run of fluxora-webhooks under faults, ending with an
accounting of every event and a non-zero exit on any loss.

    .venv/bin/python scripts/soak.py --minutes 10 [--seed N] [--rate 200]

It starts ``--dispatchers`` real ``fluxora-webhooks run`` processes against a database of
its own (created on the machine's PostgreSQL and dropped afterwards, or ``DATABASE_URL``),
a Redis server of its own (so it can stop and freeze it) and a consumer on loopback that
misbehaves at random. A producer commits ``--rate`` events a second. Meanwhile, faults
arrive every few seconds: kill -9 of a dispatcher (a replacement starts), SIGTERM of one,
``pg_terminate_backend`` of the dispatchers' backends, Redis stopped or frozen, the
consumer down, and consumer storms (every request slow, silent, reset, 503 or endless for
a few seconds). Then the faults stop, the consumer calms down, the outbox drains, and the
accounting table is printed (see ``tests/support/chaos.py:Accounting``).

Exit status: 0 when nothing was lost; 1 on a loss (or a delivery recorded twice, or one
recorded without a 2xx); 2 when nothing was lost but a dispatcher crashed on its own or
wrote a traceback.

Replay: ``--seed`` fixes the fault schedule (times, kinds, durations, victims) and the
consumer's answer to every (event, attempt); the operating system's timing is not replayed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402
from tests.support import engines  # noqa: E402
from tests.support.chaos import (  # noqa: E402
    Behaviour,
    ChaosConsumer,
    Hit,
    account,
    dbname_of,
    format_table,
    rss_bytes,
    terminate_backends,
    tracebacks,
    wait_ready,
)
from tests.support.procs import DispatcherProcess, dispatcher_env, start_dispatcher  # noqa: E402
from tests.support.redis_server import RedisServer, free_port  # noqa: E402

from fluxora_webhooks.migrations import migrate  # noqa: E402

APP = "fluxora-soak"  # application_name of the soak's own connections (never terminated)
TIMEOUT_MS = 2000

# The consumer, per (event, attempt), outside storms: rare permanent 4xx on a first
# attempt (dead letters), and a few percent of every kind of misbehaviour.
GONE_P = 0.002
MISBEHAVE_P = 0.04
MISBEHAVIOURS = [
    Behaviour.RETRY, Behaviour.SLOW, Behaviour.SILENT, Behaviour.RESET_HEAD,
    Behaviour.RESET_BODY, Behaviour.ENDLESS, Behaviour.TRICKLE, Behaviour.HUGE_HEADERS,
    Behaviour.OVERSIZED_HEADER, Behaviour.GARBAGE_2XX, Behaviour.CLOSE_AFTER,
]  # fmt: skip
STORMS = [Behaviour.RETRY, Behaviour.SLOW, Behaviour.SILENT, Behaviour.RESET_HEAD,
          Behaviour.ENDLESS]  # fmt: skip

# Fault kinds: (weight, the resource it acts on). Faults on one resource take turns;
# faults on different resources may overlap.
FAULTS = {
    "kill -9 dispatcher": (30, "dispatchers"),
    "SIGTERM dispatcher": (8, "dispatchers"),
    "pg_terminate_backend": (20, "postgres"),
    "Redis stopped": (8, "redis"),
    "Redis frozen": (6, "redis"),
    "consumer down": (6, "consumer"),
    "consumer storm": (22, "consumer"),
}


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    duration_s: float
    pick: float  # which dispatcher, which storm: a draw of the schedule's own
    storm: Behaviour = Behaviour.RETRY


def fault_schedule(seed: int, run_s: float) -> list[Fault]:
    """Every fault of a run, from the seed alone (so a seed replays the same faults)."""
    rng = random.Random(seed)
    kinds, weights = list(FAULTS), [weight for weight, _ in FAULTS.values()]
    faults: list[Fault] = []
    at = rng.uniform(3, 6)
    while at < run_s - 5:
        kind = rng.choices(kinds, weights)[0]
        faults.append(Fault(at, kind, rng.uniform(1.5, 6.0), rng.random(), rng.choice(STORMS)))
        at += rng.uniform(2.0, 7.0)
    return faults


def answer_for(seed: int, n: int | None, attempt: int) -> Behaviour:
    """The consumer's answer to attempt ``attempt`` of event ``n``, from the seed alone."""
    rng = random.Random((seed << 48) ^ ((n or 0) << 8) ^ attempt)
    draw = rng.random()
    if attempt == 1 and draw < GONE_P:
        return Behaviour.GONE
    if draw < GONE_P + MISBEHAVE_P:
        return rng.choice(MISBEHAVIOURS)
    return Behaviour.OK


@dataclass
class Fleet:
    """The dispatcher processes: ``size`` slots, each refilled when its process goes."""

    size: int
    env: dict[str, str]
    folder: Path
    procs: list[DispatcherProcess] = field(default_factory=list)
    started: int = 0
    crashed: int = 0  # exits nobody asked for
    logs: list[Path] = field(default_factory=list)
    max_rss: int = 0
    _expected: set[int] = field(default_factory=set)

    async def start(self) -> None:
        for _ in range(self.size):
            self.procs.append(await self._launch())

    async def _launch(self) -> DispatcherProcess:
        self.started += 1
        path = self.folder / f"dispatcher-{self.started:03d}.log"
        self.logs.append(path)
        return await start_dispatcher(self.env, path)

    async def replace(self, pick: float, how: str) -> None:
        index = int(pick * len(self.procs)) % len(self.procs)
        victim = self.procs[index]
        self._expected.add(victim.pid)
        self.procs[index] = await self._launch()
        if how == "kill":
            victim.kill()
            await victim.wait(10)
        else:
            # SIGTERM drains once the process is up; during start-up it ends it outright.
            with contextlib.suppress(AssertionError):
                await wait_ready(victim)
            victim.terminate()
            code = await victim.wait(TIMEOUT_MS / 1000 + 15)
            if code != 0:
                self.crashed += 1
                print(f"  ! dispatcher {victim.pid} exited {code} after SIGTERM", flush=True)

    async def watch(self) -> None:
        """Refill slots whose process exited unasked; sample memory."""
        while True:
            for i, proc in enumerate(self.procs):
                if proc.proc.returncode is not None and proc.pid not in self._expected:
                    self.crashed += 1
                    print(f"  ! dispatcher {proc.pid} exited {proc.proc.returncode}", flush=True)
                    self.procs[i] = await self._launch()
                with contextlib.suppress(Exception):
                    self.max_rss = max(self.max_rss, rss_bytes(proc.pid))
            await asyncio.sleep(1.0)

    async def stop(self) -> list[int]:
        codes = []
        for proc in self.procs:
            with contextlib.suppress(AssertionError):
                await wait_ready(proc)
        for proc in self.procs:
            self._expected.add(proc.pid)
            proc.terminate()
        for proc in self.procs:
            try:
                codes.append(await proc.wait(TIMEOUT_MS / 1000 + 15))
            except TimeoutError:
                proc.kill()
                codes.append(await proc.wait(10))
        return codes

    def tracebacks(self) -> int:
        return sum(tracebacks(p.read_text(errors="replace")) for p in self.logs if p.exists())


class Soak:
    def __init__(self, args: argparse.Namespace, database_url: str, admin_url: str) -> None:
        self.args = args
        self.seed: int = args.seed
        self.database_url = database_url
        self.admin_url = admin_url
        self.folder = Path(args.workdir)
        self.redis = RedisServer(free_port(), self.folder)
        self.consumer = ChaosConsumer(
            self.choose, slow_s=TIMEOUT_MS / 1000 + 1, close_probability=0.02,
            seed=self.seed, keep_headers=False,
        )  # fmt: skip
        self.storm: Behaviour | None = None
        self.calm = False
        self.committed: list[int] = []
        self.produced = 0
        self.faults: Counter[str] = Counter()
        self.fault_errors = 0
        self.fleet: Fleet | None = None

    def choose(self, hit: Hit) -> Behaviour:
        if self.calm:
            return Behaviour.OK
        if self.storm is not None:
            return self.storm
        return answer_for(self.seed, hit.n, hit.attempt)

    # -- the producer -----------------------------------------------------------------

    async def produce(self, until: float) -> None:
        """Commit ``rate`` events a second (in ticks of 100 ms) until ``until``."""
        started = time.monotonic()
        conn: psycopg.AsyncConnection[Any] | None = None
        while time.monotonic() < until:
            due = int((time.monotonic() - started) * self.args.rate)
            count = min(due - self.produced, 2000)
            if count > 0:
                first = self.produced + 1
                try:
                    if conn is None or conn.closed:
                        conn = await psycopg.AsyncConnection.connect(
                            self.database_url, autocommit=True, application_name=APP
                        )
                    await conn.execute(
                        "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                        " SELECT 'soak-' || (n %% 1000), 'soak.event',"
                        "        jsonb_build_object('n', n, 'kind', 'soak')"
                        " FROM generate_series(%s::bigint, %s::bigint) n",
                        (first, first + count - 1),
                    )
                    self.committed.extend(range(first, first + count))
                except psycopg.OperationalError as exc:
                    # Unknown whether it committed: the accounting reads the table.
                    print(f"  producer: {type(exc).__name__}; reconnecting", flush=True)
                    if conn is not None:
                        await conn.close()
                    conn = None
                self.produced += count
            await asyncio.sleep(0.1)
        if conn is not None:
            await conn.close()

    # -- faults ---------------------------------------------------------------------

    async def inject(self, fault: Fault) -> None:
        assert self.fleet is not None
        self.faults[fault.kind] += 1
        if fault.kind == "kill -9 dispatcher":
            await self.fleet.replace(fault.pick, "kill")
        elif fault.kind == "SIGTERM dispatcher":
            await self.fleet.replace(fault.pick, "term")
        elif fault.kind == "pg_terminate_backend":
            await terminate_backends(self.admin_url, dbname_of(self.database_url), spare=APP)
        elif fault.kind == "Redis stopped":
            await asyncio.to_thread(self.redis.stop)
            await asyncio.sleep(fault.duration_s)
            await asyncio.to_thread(self.redis.start)
        elif fault.kind == "Redis frozen":
            self.redis.freeze()
            await asyncio.sleep(fault.duration_s / 2)
            self.redis.thaw()
        elif fault.kind == "consumer down":
            await self.consumer.stop()
            await asyncio.sleep(fault.duration_s / 2)
            await self.consumer.start()
        elif fault.kind == "consumer storm":
            self.storm = fault.storm
            await asyncio.sleep(fault.duration_s)
            self.storm = None

    async def run_faults(self, schedule: list[Fault], t0: float) -> None:
        # One fault at a time per resource; faults of different kinds may overlap.
        locks: dict[str, asyncio.Lock] = {}
        running: set[asyncio.Task[None]] = set()

        async def one(fault: Fault) -> None:
            lock = locks.setdefault(FAULTS[fault.kind][1], asyncio.Lock())
            async with lock:
                print(f"  {time.monotonic() - t0:6.1f}s  {fault.kind}", flush=True)
                try:
                    await self.inject(fault)
                except Exception as exc:  # a fault that failed to inject is reported
                    self.fault_errors += 1
                    print(f"  ! fault {fault.kind} failed: {exc!r}", flush=True)

        try:
            for fault in schedule:
                await asyncio.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
                task = asyncio.create_task(one(fault))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            await asyncio.gather(*running, return_exceptions=True)

    # -- the run --------------------------------------------------------------------

    async def run(self) -> int:
        args = self.args
        run_s = args.minutes * 60
        schedule = fault_schedule(self.seed, run_s)
        print(
            f"soak: seed {self.seed}, {args.minutes} min at {args.rate} events/s,"
            f" {args.dispatchers} dispatchers, {len(schedule)} faults scheduled;"
            f" logs in {self.folder}",
            flush=True,
        )
        await asyncio.to_thread(self.redis.start)
        await self.consumer.start()
        env = dispatcher_env(
            self.database_url, f"redis://127.0.0.1:{self.redis.port}/0", self.consumer.url,
            f"soak:{uuid.uuid4().hex[:8]}:",
            WEBHOOK_TIMEOUT_MS=str(TIMEOUT_MS), WEBHOOK_BATCH_SIZE="20",
            WEBHOOK_CLAIM_LOOPS="4", WEBHOOK_POLL_INTERVAL_MS="1000",
            WEBHOOK_RETRY_SCHEDULE="200ms,1s,2s,5s", WEBHOOK_MAX_ATTEMPTS="8",
            WEBHOOK_RETRY_RPS="100", WEBHOOK_CIRCUIT_BREAKER_THRESHOLD="30",
            WEBHOOK_CIRCUIT_BREAKER_RESET_MS="2000",
        )  # fmt: skip
        self.fleet = fleet = Fleet(args.dispatchers, env, self.folder)
        t0 = time.monotonic()
        codes: list[int] = []
        try:
            await fleet.start()
            watcher = asyncio.create_task(fleet.watch())
            await asyncio.gather(
                self.produce(t0 + run_s), self.run_faults(schedule, t0), self.progress(t0, run_s)
            )
            print(f"  {time.monotonic() - t0:6.1f}s  faults over; draining", flush=True)
            self.calm = True
            drained = await self.drain(args.drain_timeout)
            watcher.cancel()
        finally:
            codes = await fleet.stop()
            await self.consumer.stop()
            await asyncio.to_thread(self.redis.stop)
        elapsed = time.monotonic() - t0
        accounting = await account(self.database_url, self.consumer, self.committed)
        print()
        print(format_table(accounting))
        print(
            "lost = committed events neither delivered (a 2xx the consumer wrote, recorded"
            " in the outbox)\n       nor dead-lettered; it must be 0"
        )
        late, other = duplicate_causes(self.consumer)
        print(
            f"duplicates: {late:,} after a 2xx written past the dispatcher's timeout,"
            f" {other:,} after kills, terminations and resets"
        )
        print()
        rate = accounting.written / run_s
        print(f"seed {self.seed}; {elapsed / 60:.1f} min in all; {rate:.0f} events/s written")
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        print(f"faults injected: {sum(self.faults.values())} ({faults})")
        print(
            f"dispatchers: {fleet.started} started, {fleet.crashed} exited unasked,"
            f" max RSS {fleet.max_rss / 2**20:.0f} MiB, {fleet.tracebacks()} tracebacks,"
            f" final exits {codes}"
        )
        print(f"consumer: {self.consumer.endless_bytes_sent / 2**20:.0f} MiB of endless bodies")
        if not drained:
            print(f"the outbox did not drain within {args.drain_timeout}s")
        if not accounting.ok:
            print(f"LOST or mis-recorded events (first few): {accounting.lost_ids}")
            return 1
        if fleet.crashed or fleet.tracebacks() or self.fault_errors or any(codes):
            return 2
        return 0

    async def progress(self, t0: float, run_s: float) -> None:
        while (left := t0 + run_s - time.monotonic()) > 0:
            await asyncio.sleep(min(30.0, left))
            pending = await _pending(self.database_url)
            print(
                f"  {time.monotonic() - t0:6.1f}s  committed {len(self.committed):,},"
                f" consumer read {len(self.consumer.hits):,}, pending {pending}",
                flush=True,
            )

    async def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await _pending(self.database_url) == 0:
                return True
            await asyncio.sleep(0.5)
        return False


def duplicate_causes(consumer: ChaosConsumer) -> tuple[int, int]:
    """Duplicate 2xx answers: (those after a "slow" 2xx the dispatcher had given up on,
    the rest: crashes, terminations and resets between the answer and the commit)."""
    late = other = 0
    earlier_late: dict[str, bool] = {}
    for hit in consumer.hits:  # in the order the consumer read them
        if hit.answered is None or not 200 <= hit.answered < 300:
            continue
        if hit.delivery_id in earlier_late:
            if earlier_late[hit.delivery_id]:
                late += 1
            else:
                other += 1
        was_late = earlier_late.get(hit.delivery_id, False) or hit.behaviour is Behaviour.SLOW
        earlier_late[hit.delivery_id] = was_late
    return late, other


async def _pending(database_url: str) -> int | str:
    try:
        async with await psycopg.AsyncConnection.connect(
            database_url, autocommit=True, application_name=APP
        ) as conn:
            cur = await conn.execute("SELECT count(*) FROM webhook_outbox WHERE NOT processed")
            row = await cur.fetchone()
            return int(row[0]) if row else 0
    except psycopg.OperationalError as exc:
        return type(exc).__name__


# -- the database of the run -----------------------------------------------------------


async def _create_database(admin_url: str, name: str) -> str:
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = engines.with_dbname(admin_url, name)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
    return url


async def _drop_database(admin_url: str, name: str) -> None:
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


async def _given_database(url: str) -> str:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
        cur = await conn.execute("SELECT EXISTS (SELECT 1 FROM webhook_outbox)")
        row = await cur.fetchone()
    if row and row[0]:
        raise SystemExit("soak: DATABASE_URL's outbox is not empty; the accounting needs it so")
    return url


async def main_async(args: argparse.Namespace) -> int:
    given = args.database_url or os.environ.get("DATABASE_URL", "").strip()
    if given:
        database_url = await _given_database(given)
        admin_url, name = given, None
    else:
        admin_url = engines.admin_database_url()
        name = f"fluxora_soak_{uuid.uuid4().hex[:10]}"
        database_url = await _create_database(admin_url, name)
    try:
        return await Soak(args, database_url, admin_url).run()
    finally:
        if name is not None and not args.keep:
            await _drop_database(admin_url, name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the run")
    parser.add_argument("--seed", type=int, default=None, help="replay a run's faults")
    parser.add_argument("--rate", type=int, default=200, help="events committed per second")
    parser.add_argument("--dispatchers", type=int, default=3)
    parser.add_argument("--drain-timeout", type=float, default=300.0)
    parser.add_argument("--database-url", default=None, help="default: DATABASE_URL, else a"
                        " database of its own on the machine's PostgreSQL")  # fmt: skip
    parser.add_argument("--workdir", default=None, help="logs (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the database and the logs")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(2**32)
    if args.minutes <= 0 or args.rate <= 0 or args.dispatchers <= 0:
        parser.error("--minutes, --rate and --dispatchers must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    own_folder = args.workdir is None
    if own_folder:
        args.workdir = tempfile.mkdtemp(prefix=f"fluxora-soak-{args.seed}-")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    code = asyncio.run(main_async(args))
    if own_folder and code == 0 and not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    elif code:
        print(f"logs kept in {args.workdir}; replay with --seed {args.seed}")
    return code


if __name__ == "__main__":
    sys.exit(main())
