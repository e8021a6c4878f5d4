"""What a batch costs the client and the database when its rows are held locked in a
transaction (as the dispatcher does today) or leased by one autocommit statement.

    .venv/bin/python benchmarks/leases.py [--database-url URL] [--rounds N] [--batches N]
                                          [--database NAME] [--results DIR]

``--database-url`` is an administrative connection (default ``$DATABASE_URL`` or
``dbname=postgres``); the benchmark creates its own scratch database (``--database``,
default ``lease_bench``) on that server, dropped first if it exists and dropped again at
the end, also on error. It is migrated with the project's own ``migrate`` and filled with
enough pending rows (the producer's ``INSERT INTO webhook_outbox (stream_id, event_type,
payload)``, a payload of about 200 bytes) for every shape of every round, then
``VACUUM ANALYZE``d.

Four shapes of the batch of ten rows, with no HTTP in between (only the transaction shape
is measured), alternating within each round (the order rotates from round to round):

- ``held``: today's claim loop on one autocommit connection: ``conn.transaction()``
  (``BEGIN``), the dispatcher's claim (``claim_due``: ``SELECT ... FOR UPDATE SKIP
  LOCKED``), the completion, ``COMMIT``.
- ``leased_k1``: one autocommit statement claims the rows and leases them (``UPDATE ...
  SET created_at = now() + 40 s, lease = <uuid> FROM (<the same claim>) RETURNING``), then
  the completion of that batch, autocommit, on the same connection.
- ``leased_k4``, ``leased_k8``: k claim-and-lease statements one after another (as k claim
  loops would), then ONE completion statement for all k batches on a second connection
  (a shared completer).

The completion is the same simplified statement in every shape (processed, processed_at,
outcome 'delivered', status_code, duration_ms, lease = NULL; the rows named by id,
partition_at and, when leased, the lease), its arrays psycopg parameters.

Per batch, for each shape and round: the client's CPU (``time.process_time``), the CPU of
the backends the shape uses (``/proc/<pid>/stat``), the wall time, and the WAL written
(``pg_current_wal_insert_lsn()`` before and after, read on a third connection; WAL is
cluster-wide, so other work on the server counts too). Also, per window: the row updates,
how many of them were HOT and the dead tuples left (``pg_stat_user_tables``), the
full-page images (``pg_stat_wal``), and what the ``VACUUM`` after the window cost
(backend CPU and WAL per batch). The table is vacuumed before each measured window, so
every window starts from the same state. Round trips are counted once per shape from
libpq's protocol trace of what psycopg sends (one per ``Sync`` or simple ``Query``).

At the end it checks that every row claimed was completed exactly once by the shape that
claimed it and that no lease is left. Prints markdown tables and keeps the figures as
``<results>/leases-<timestamp>.json``. Loopback only; bounded loops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
from benchlib import PAD, keep, process_cpu_s, run, scratch_database
from psycopg import pq

from fluxora_webhooks.migrations import migrate
from fluxora_webhooks.queries import query

BATCH = 10
LEASE_SECONDS = 40
WARMUP = 50
TRACED_BATCHES = 8  # a multiple of every k
SPARE_ROWS = 100  # left pending at the end, so every claim gets a full batch


def _strip_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))


# The dispatcher's claim (claim_due with the batch size written in, as outbox._claim_sql
# does), comments left out.
CLAIM = _strip_comments(query("claim_due")).replace("%(batch)s", str(BATCH))
assert "%(" not in CLAIM, "claim_due: a parameter other than the batch size"

# Claim and lease in one statement: the row is not due again until the lease ends, so a
# dead dispatcher's rows come back. RETURNING the claim's own columns, in its order.
LEASE_CLAIM = f"""UPDATE webhook_outbox o
SET created_at = now() + interval '{LEASE_SECONDS} seconds', lease = %(lease)s::uuid
FROM (
{CLAIM}
) c
WHERE o.id = c.id AND o.partition_at = c.partition_at
RETURNING c.*"""

# The completion, the same in every shape: complete_done reduced to a delivered attempt.
COMPLETE = """UPDATE webhook_outbox o
SET processed = true, processed_at = clock_timestamp(), outcome = 'delivered',
    status_code = r.status_code, duration_ms = r.duration_ms, lease = NULL
FROM unnest(%(ids)s::bigint[], %(parts)s::timestamptz[], %(leases)s::uuid[],
            %(codes)s::int[], %(durations)s::float8[])
     AS r(id, partition_at, lease, status_code, duration_ms)
WHERE o.id = r.id AND o.partition_at = r.partition_at
  AND o.processed IS FALSE AND (r.lease IS NULL OR o.lease = r.lease)"""

INSERT = """INSERT INTO webhook_outbox (stream_id, event_type, payload)
SELECT 'stream-' || (g %% 100), 'bench.event',
       jsonb_build_object('kind', 'bench', 'seq', g, 'pad', %(pad)s::text)
FROM generate_series(1, %(n)s) AS g"""

ID, PARTITION_AT = 0, 14  # the claim's columns
TABLE_STATS = (
    "SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup FROM pg_stat_user_tables"
    " WHERE relid = 'webhook_outbox'::regclass"
)
WAL_STATS = "SELECT pg_current_wal_insert_lsn(), wal_records, wal_fpi FROM pg_stat_wal"

# name: (k, its code in duration_ms: which shape completed a row, checked at the end)
SHAPES: dict[str, tuple[int, float]] = {
    "held": (1, 1.0),
    "leased_k1": (1, 2.0),
    "leased_k4": (4, 3.0),
    "leased_k8": (8, 4.0),
}


WALDUMP_LINE = re.compile(
    r"^rmgr: (\w+)\s+len \(rec/tot\):\s*(\d+)/\s*(\d+), tx:\s*(\d+), lsn: [^,]+,"
    r" prev [^,]+, desc: (.*)$"
)
WALDUMP_REL = re.compile(r"rel \d+/(\d+)/\d+")


class OwnWal:
    """The WAL records of one database in an LSN range, from ``pg_waldump`` (the server's
    WAL is shared: other databases' writes fall in the same range). A record is ours when
    one of its blocks is in our database, or it is the commit of a transaction that wrote
    one. Bytes are the records' MAXALIGNed lengths (no page headers)."""

    def __init__(self, waldump: str | None, wal_dir: str, dboid: int) -> None:
        self.waldump, self.wal_dir, self.dboid = waldump, wal_dir, str(dboid)

    def __call__(self, start: str, end: str) -> dict[str, Any] | None:
        if self.waldump is None or not os.access(self.wal_dir, os.R_OK):
            return None
        proc = subprocess.run(
            [self.waldump, "-p", self.wal_dir, "-s", start, "-e", end],
            capture_output=True,
            text=True,
            check=False,
        )
        xids: set[str] = set()
        own = {"bytes": 0, "fpi_bytes": 0, "records": 0, "fpi": 0, "all_bytes": 0}
        kinds: dict[str, int] = {}
        for line in proc.stdout.splitlines():
            match = WALDUMP_LINE.match(line)
            if not match:
                continue
            rmgr, rec, total, tx, desc = match.groups()
            size = (int(total) + 7) // 8 * 8
            own["all_bytes"] += size
            if self.dboid in WALDUMP_REL.findall(desc):
                if tx != "0":
                    xids.add(tx)
            elif not (rmgr == "Transaction" and tx in xids):
                continue
            own["bytes"] += size
            own["fpi_bytes"] += int(total) - int(rec)  # the record's block images
            own["records"] += 1
            own["fpi"] += desc.count(" FPW")
            kind = f"{rmgr} {desc.split(' ', 1)[0].rstrip(',')}"
            kinds[kind] = kinds.get(kind, 0) + 1
        return {**own, "kinds": kinds, "waldump_error": proc.stderr.strip()[-300:] or None}


async def reserve_wal(conn: psycopg.AsyncConnection[Any]) -> str | None:
    """A temporary physical replication slot, so that a checkpoint (another database's
    DROP DATABASE forces one) does not recycle the WAL pg_waldump has still to read. It
    goes with the session; advanced before each window."""
    slot = f"leases_bench_{os.getpid()}"
    try:
        await conn.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", (slot,))
    except psycopg.Error as e:
        print(f"no replication slot ({e}); a checkpoint may recycle WAL before it is read")
        return None
    return slot


def warmup_batches(k: int) -> int:
    return math.ceil(WARMUP / k) * k


def measured_batches(k: int, batches: int) -> int:
    return math.ceil(batches / k) * k


class Bench:
    def __init__(
        self,
        loop: psycopg.AsyncConnection[Any],
        completer: psycopg.AsyncConnection[Any],
        monitor: psycopg.AsyncConnection[Any],
        own_wal: OwnWal,
    ) -> None:
        self.own_wal = own_wal
        self.slot: str | None = None
        self.loop = loop  # the claim loop's connection (every shape's claims)
        self.completer = completer  # the shared completer's (leased_k4, leased_k8)
        self.monitor = monitor  # readings and VACUUM, outside the measured work
        self.claimed: dict[float, list[int]] = {code: [] for _, code in SHAPES.values()}
        self.completed = 0

    def unit(self, name: str) -> Callable[[], Awaitable[None]]:
        """One step of the shape: k batches claimed and completed."""
        k, code = SHAPES[name]
        if name == "held":
            return lambda: self.held(code)
        return lambda: self.leased(k, code)

    def pids(self, name: str) -> list[int]:
        k = SHAPES[name][0]
        used = [self.loop] if k == 1 else [self.loop, self.completer]
        return [conn.info.backend_pid for conn in used]

    async def held(self, code: float) -> None:
        conn = self.loop
        async with conn.transaction():
            cur = await conn.execute(CLAIM)
            rows = await cur.fetchall()
            await self.complete(conn, [(rows, None)], code)

    async def leased(self, k: int, code: float) -> None:
        batches: list[tuple[list[Any], uuid.UUID | None]] = []
        for _ in range(k):
            lease = uuid.uuid4()
            cur = await self.loop.execute(LEASE_CLAIM, {"lease": lease})
            batches.append((await cur.fetchall(), lease))
        await self.complete(self.loop if k == 1 else self.completer, batches, code)

    async def complete(
        self,
        conn: psycopg.AsyncConnection[Any],
        batches: list[tuple[list[Any], uuid.UUID | None]],
        code: float,
    ) -> None:
        ids: list[int] = []
        parts: list[Any] = []
        leases: list[uuid.UUID | None] = []
        for rows, lease in batches:
            if len(rows) != BATCH:
                raise RuntimeError(f"a claim got {len(rows)} rows, not {BATCH}")
            for row in rows:
                ids.append(row[ID])
                parts.append(row[PARTITION_AT])
                leases.append(lease)
        n = len(ids)
        params = {
            "ids": ids,
            "parts": parts,
            "leases": leases,
            "codes": [200] * n,
            "durations": [code] * n,
        }
        cur = await conn.execute(COMPLETE, params)
        if cur.rowcount != n:
            raise RuntimeError(f"the completion updated {cur.rowcount} rows of {n}")
        self.claimed[code].extend(ids)
        self.completed += n

    async def settle(self) -> None:
        """Let every backend flush its pending statistics (at most once a second, when idle)."""
        await asyncio.sleep(1.2)
        for conn in (self.loop, self.completer, self.monitor):
            await conn.execute("SELECT 1")

    async def reading(self) -> dict[str, Any]:
        cur = await self.monitor.execute(WAL_STATS)
        lsn, records, fpi = (await cur.fetchone()) or (None, 0, 0)
        cur = await self.monitor.execute(TABLE_STATS)
        upd, hot, dead = (await cur.fetchone()) or (0, 0, 0)
        return {"lsn": lsn, "records": records, "fpi": fpi, "upd": upd, "hot": hot, "dead": dead}

    async def lsn(self) -> Any:
        cur = await self.monitor.execute("SELECT pg_current_wal_insert_lsn()")
        row = await cur.fetchone()
        return row[0] if row else None

    async def own(self, start: Any, end: Any, n: int) -> dict[str, Any] | None:
        """Our database's WAL between two LSNs, per batch (once it is flushed)."""
        for _ in range(50):
            cur = await self.monitor.execute("SELECT pg_current_wal_flush_lsn() >= %s", (end,))
            row = await cur.fetchone()
            if row and row[0]:
                break
            await asyncio.sleep(0.1)
        found = await asyncio.to_thread(self.own_wal, str(start), str(end))
        if found is None:
            return None
        return {
            "bytes": found["bytes"] / n,
            "bytes_without_fpi": (found["bytes"] - found["fpi_bytes"]) / n,
            "fpi_bytes": found["fpi_bytes"] / n,
            "records": found["records"] / n,
            "fpi": found["fpi"],
            "others_bytes": (found["all_bytes"] - found["bytes"]) / n,
            "kinds": {kind: count / n for kind, count in sorted(found["kinds"].items())},
            "waldump_error": found["waldump_error"],
        }

    async def wal_bytes(self, lsn0: Any, lsn1: Any) -> int:
        cur = await self.monitor.execute("SELECT pg_wal_lsn_diff(%s, %s)", (lsn1, lsn0))
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def window(self, name: str, batches: int) -> dict[str, Any]:
        k = SHAPES[name][0]
        unit = self.unit(name)
        for _ in range(warmup_batches(k) // k):
            await unit()
        await self.monitor.execute("VACUUM webhook_outbox")
        await self.settle()
        if self.slot:  # keep the WAL from here on until the next window
            await self.monitor.execute(
                "SELECT pg_replication_slot_advance(%s, pg_current_wal_flush_lsn())", (self.slot,)
            )
        before = await self.reading()
        pids = self.pids(name)
        n = measured_batches(k, batches)
        c0, s0 = time.process_time(), sum(process_cpu_s(p) for p in pids)
        w0 = time.perf_counter()
        for _ in range(n // k):
            await unit()
        w1 = time.perf_counter()
        c1, s1 = time.process_time(), sum(process_cpu_s(p) for p in pids)
        lsn1 = await self.lsn()
        await self.settle()
        after = await self.reading()
        # What the VACUUM of this window's dead row versions costs (the next shape starts
        # from a vacuumed table either way).
        vpid = self.monitor.info.backend_pid
        v0, vl0 = process_cpu_s(vpid), await self.lsn()
        await self.monitor.execute("VACUUM webhook_outbox")
        v1, vl1 = process_cpu_s(vpid), await self.lsn()
        client_us = 1e6 * (c1 - c0) / n
        database_us = 1e6 * (s1 - s0) / n
        own = await self.own(before["lsn"], lsn1, n)
        own_vacuum = await self.own(vl0, vl1, n)
        return {
            "shape": name,
            "k": k,
            "batches": n,
            "client_us": client_us,
            "database_us": database_us,
            "total_us": client_us + database_us,
            "wall_us": 1e6 * (w1 - w0) / n,
            "wal_bytes": await self.wal_bytes(before["lsn"], lsn1) / n,
            "wal_records": (after["records"] - before["records"]) / n,
            "wal_fpi": after["fpi"] - before["fpi"],
            "row_updates": (after["upd"] - before["upd"]) / n,
            "hot_updates": (after["hot"] - before["hot"]) / n,
            "dead_tuples": (after["dead"] - before["dead"]) / n,
            "vacuum_us": 1e6 * (v1 - v0) / n,
            "vacuum_wal_bytes": await self.wal_bytes(vl0, vl1) / n,
            "own_wal_bytes": own["bytes"] if own else None,
            "own_wal_bytes_without_fpi": own["bytes_without_fpi"] if own else None,
            "own_wal": own,
            "vacuum_own_wal_bytes": own_vacuum["bytes"] if own_vacuum else None,
            "vacuum_own_wal_bytes_without_fpi": (
                own_vacuum["bytes_without_fpi"] if own_vacuum else None
            ),
            "vacuum_own_wal": own_vacuum,
        }

    async def round_trips(self, name: str) -> dict[str, Any]:
        """What psycopg sends for TRACED_BATCHES batches of the shape, from libpq's trace."""
        k = SHAPES[name][0]
        unit = self.unit(name)
        conns = {"loop": self.loop, "completer": self.completer}
        trips = messages = 0
        first_unit: list[str] = []
        with contextlib.ExitStack() as stack:
            files = {key: stack.enter_context(tempfile.TemporaryFile("w+")) for key in conns}
            for key, conn in conns.items():
                conn.pgconn.trace(files[key].fileno())
                conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            try:
                for _ in range(TRACED_BATCHES // k):
                    await unit()
            finally:
                for conn in conns.values():
                    conn.pgconn.untrace()
            for key, f in files.items():
                f.seek(0)
                sent: list[str] = []
                for line in f:
                    fields = line.rstrip("\n").split("\t")
                    if len(fields) < 3 or fields[0] != "F":
                        continue
                    messages += 1
                    kind = fields[2]
                    if kind == "Query":
                        kind += fields[3] if len(fields) > 3 else ""
                    sent.append(kind)
                    if fields[2] in ("Sync", "Query"):
                        trips += 1
                per_unit = len(sent) * k // TRACED_BATCHES
                if per_unit:
                    first_unit.append(f"{key}: " + " ".join(sent[:per_unit]))
        return {
            "round_trips_per_batch": trips / TRACED_BATCHES,
            "messages_per_batch": messages / TRACED_BATCHES,
            "sent_per_step": first_unit,
        }

    async def check(self, inserted: int) -> dict[str, Any]:
        """Every claimed row completed once, by the shape that claimed it; no lease left."""
        report: dict[str, Any] = {"inserted": inserted}
        every: list[int] = []
        for name, (_, code) in SHAPES.items():
            ids = self.claimed[code]
            every += ids
            cur = await self.monitor.execute(
                "SELECT array_agg(id ORDER BY id) FROM webhook_outbox"
                " WHERE processed AND duration_ms = %s",
                (code,),
            )
            row = await cur.fetchone()
            in_db = list(row[0] or []) if row else []
            ok = len(ids) == len(set(ids)) and sorted(ids) == in_db
            report[name] = {"claimed": len(ids), "processed": len(in_db), "ok": ok}
        cur = await self.monitor.execute(
            "SELECT count(*) FILTER (WHERE processed), count(*) FILTER (WHERE NOT processed),"
            " count(*) FILTER (WHERE lease IS NOT NULL),"
            " count(*) FILTER (WHERE NOT processed AND created_at > now())"
            " FROM webhook_outbox"
        )
        processed, pending, leased, not_due = (await cur.fetchone()) or (0, 0, 0, 0)
        report.update(
            processed=processed, pending=pending, leased_left=leased, pending_not_due=not_due
        )
        report["ok"] = (
            all(report[name]["ok"] for name in SHAPES)
            and len(every) == len(set(every)) == processed == self.completed
            and pending == inserted - processed
            and leased == 0
            and not_due == 0
        )
        return report


async def measure_all(args: argparse.Namespace, url: str) -> dict[str, Any]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
        per_round = sum(
            warmup_batches(k) + measured_batches(k, args.batches) for k, _ in SHAPES.values()
        )
        inserted = BATCH * (args.rounds * per_round + TRACED_BATCHES * len(SHAPES)) + SPARE_ROWS
        await conn.execute(INSERT, {"pad": PAD, "n": inserted})
        await conn.execute("VACUUM ANALYZE webhook_outbox")
        cur = await conn.execute(
            "SELECT avg(pg_column_size(payload)) FROM webhook_outbox"  # the payload's size
        )
        row = await cur.fetchone()
        payload_bytes = float(row[0]) if row else 0.0
        cur = await conn.execute("EXPLAIN (COSTS OFF) " + LEASE_CLAIM, {"lease": uuid.uuid4()})
        plan = [r[0] for r in await cur.fetchall()]
        cur = await conn.execute(
            "SELECT (SELECT oid FROM pg_database WHERE datname = current_database()),"
            " current_setting('data_directory'), current_setting('server_version_num')::int"
        )
        row = await cur.fetchone()
        assert row is not None
        dboid, data_dir, version = int(row[0]), str(row[1]), int(row[2])
    waldump = shutil.which("pg_waldump") or f"/usr/lib/postgresql/{version // 10000}/bin/pg_waldump"
    own_wal = OwnWal(waldump if os.access(waldump, os.X_OK) else None, data_dir + "/pg_wal", dboid)
    print(f"{inserted:,} pending rows, payload {payload_bytes:.0f} bytes as jsonb")
    print("plan of the claim-and-lease statement:\n    " + "\n    ".join(plan))

    loop = await psycopg.AsyncConnection.connect(url, autocommit=True)
    completer = await psycopg.AsyncConnection.connect(url, autocommit=True)
    monitor = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        bench = Bench(loop, completer, monitor, own_wal)
        if own_wal.waldump:
            bench.slot = await reserve_wal(monitor)
        names = list(SHAPES)
        runs: list[dict[str, Any]] = []
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                result = await bench.window(name, args.batches)
                runs.append({"round": round_ + 1, **result})
                print(
                    f"round {round_ + 1} {name}: client {result['client_us']:.0f} us,"
                    f" database {result['database_us']:.0f} us,"
                    f" wall {result['wall_us']:.0f} us, WAL {result['wal_bytes']:,.0f} B",
                    flush=True,
                )
        trips = {name: await bench.round_trips(name) for name in names}
        check = await bench.check(inserted)
    finally:
        for c in (loop, completer, monitor):
            await c.close()
    return {
        "batch": BATCH,
        "batches": args.batches,
        "rounds": args.rounds,
        "warmup": WARMUP,
        "lease_seconds": LEASE_SECONDS,
        "inserted": inserted,
        "payload_bytes": payload_bytes,
        "statements": {"claim": CLAIM, "lease_claim": LEASE_CLAIM, "complete": COMPLETE},
        "lease_claim_plan": plan,
        "runs": runs,
        "round_trips": trips,
        "check": check,
    }


def _median(values: list[Any]) -> float:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else float("nan")


MAIN_KEYS = (
    "client_us",
    "database_us",
    "total_us",
    "wall_us",
    "wal_bytes",
    "own_wal_bytes",
    "own_wal_bytes_without_fpi",
)
ROW_KEYS = (
    "row_updates",
    "hot_updates",
    "dead_tuples",
    "vacuum_us",
    "vacuum_wal_bytes",
    "vacuum_own_wal_bytes",
    "vacuum_own_wal_bytes_without_fpi",
)


def summarize(out: dict[str, Any]) -> dict[str, dict[str, float]]:
    medians: dict[str, dict[str, float]] = {}
    for name in SHAPES:
        mine = [r for r in out["runs"] if r["shape"] == name]
        medians[name] = {key: _median([r[key] for r in mine]) for key in MAIN_KEYS + ROW_KEYS}
        medians[name]["round_trips"] = out["round_trips"][name]["round_trips_per_batch"]
    return medians


def _own_kinds(out: dict[str, Any], name: str) -> dict[str, float]:
    """Median count per batch of each kind of WAL record our database wrote."""
    owns = [r["own_wal"] for r in out["runs"] if r["shape"] == name and r["own_wal"]]
    kinds = sorted({kind for own in owns for kind in own["kinds"]})
    return {kind: _median([own["kinds"].get(kind, 0.0) for own in owns]) for kind in kinds}


def print_tables(out: dict[str, Any], medians: dict[str, dict[str, float]]) -> None:
    print()
    print(
        "| round | shape | client (us) | database (us) | client+database (us) | wall (us)"
        " | WAL (bytes) | own WAL (bytes) | own WAL without FPIs (bytes) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["runs"]:
        own = [
            "-" if r[key] is None else f"{r[key]:,.0f}"
            for key in ("own_wal_bytes", "own_wal_bytes_without_fpi")
        ]
        print(
            f"| {r['round']} | {r['shape']} | {r['client_us']:,.0f} | {r['database_us']:,.0f}"
            f" | {r['total_us']:,.0f} | {r['wall_us']:,.0f} | {r['wal_bytes']:,.0f}"
            f" | {own[0]} | {own[1]} |"
        )
    print("\nper batch of ten rows; medians over the rounds (ratio to held):\n")
    print(
        "| shape | round trips | client (us) | database (us) | client+database (us)"
        " | wall (us) | WAL (bytes) | own WAL (bytes) | own WAL without FPIs (bytes) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = medians["held"]
    for name, m in medians.items():
        cells = [
            f"{m[key]:,.0f} ({m[key] / base[key]:.2f})" if base[key] else f"{m[key]:,.0f}"
            for key in MAIN_KEYS
        ]
        print(f"| {name} | {m['round_trips']:g} | " + " | ".join(cells) + " |")
    print("\nrow versions per batch (medians) and the VACUUM after each window:\n")
    print(
        "| shape | row updates | HOT | dead tuples | VACUUM (us) | VACUUM WAL (bytes)"
        " | VACUUM own WAL (bytes) | without FPIs |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in medians.items():
        print(
            f"| {name} | {m['row_updates']:.1f} | {m['hot_updates']:.1f}"
            f" | {m['dead_tuples']:.1f} | {m['vacuum_us']:,.0f} | {m['vacuum_wal_bytes']:,.0f}"
            f" | {m['vacuum_own_wal_bytes']:,.0f} | {m['vacuum_own_wal_bytes_without_fpi']:,.0f} |"
        )
    print("\nour database's WAL records per batch (pg_waldump, medians):")
    for name in SHAPES:
        kinds = _own_kinds(out, name)
        print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in kinds.items() if v >= 0.05))
    print("\nwhat psycopg sends per step (libpq trace):")
    for name, t in out["round_trips"].items():
        print(f"  {name}: {t['round_trips_per_batch']:g} round trips per batch")
        for line in t["sent_per_step"]:
            print(f"    {line}")
    fpi = {name: [r["wal_fpi"] for r in out["runs"] if r["shape"] == name] for name in SHAPES}
    own_fpi = {
        name: [r["own_wal"]["fpi"] for r in out["runs"] if r["shape"] == name and r["own_wal"]]
        for name in SHAPES
    }
    print(f"\nfull-page images per window, whole server: {fpi}; ours: {own_fpi}")
    print(f"check: {out['check']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL", "dbname=postgres"))
    parser.add_argument("--database", default="lease_bench", help="the scratch database")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=1000, help="per shape and round")
    parser.add_argument("--results", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.rounds < 1 or args.batches < 1:
        parser.error("--rounds and --batches must be at least 1")

    with scratch_database(args.database_url, args.database) as url:
        out = run(measure_all(args, url))
    medians = summarize(out)
    out["medians"] = medians
    print_tables(out, medians)
    keep(args.results, "leases", out)
    if not out["check"]["ok"]:
        raise SystemExit("check failed: " + repr(out["check"]))


if __name__ == "__main__":
    main()
