"""The demo's payment-streams write path.

A stream pays ``rate_per_second`` of a token from a sender to a recipient. Four operations
change it (create, update, pause, cancel), and each one writes the stream and enqueues its
``stream.*`` event in **one transaction**, the way an application uses the outbox. Some
writes fail a (simulated) business check *after* the event was enqueued: the transaction
rolls back, and the event must never reach the consumer.

The demo owns the table ``demo_streams`` and every outbox and dead-letter row whose
``stream_id`` starts with :data:`STREAM_PREFIX`; it clears exactly those at the start of a
run and touches nothing else.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ..outbox import enqueue

STREAM_PREFIX = "fluxora-demo-"

SCHEMA = """
CREATE TABLE IF NOT EXISTS demo_streams (
    id              text PRIMARY KEY,
    sender          text NOT NULL,
    recipient       text NOT NULL,
    token           text NOT NULL,
    rate_per_second bigint NOT NULL CHECK (rate_per_second > 0),
    status          text NOT NULL CHECK (status IN ('active', 'paused', 'cancelled')),
    version         integer NOT NULL DEFAULT 1,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
)
"""

# Event type of each operation.
EVENTS = {
    "create": "stream.created",
    "update": "stream.updated",
    "pause": "stream.paused",
    "cancel": "stream.cancelled",
}

_RETURNING = "RETURNING id, sender, recipient, token, rate_per_second, status, version, updated_at"

_SQL = {
    "create": "INSERT INTO demo_streams (id, sender, recipient, token, rate_per_second, status)"
    " VALUES (%(id)s, %(sender)s, %(recipient)s, %(token)s, %(rate)s, 'active') " + _RETURNING,
    # An update sets a new rate; it also resumes a paused stream.
    "update": "UPDATE demo_streams SET rate_per_second = %(rate)s, status = 'active',"
    " version = version + 1, updated_at = now()"
    " WHERE id = %(id)s AND status <> 'cancelled' " + _RETURNING,
    "pause": "UPDATE demo_streams SET status = 'paused', version = version + 1,"
    " updated_at = now() WHERE id = %(id)s AND status = 'active' " + _RETURNING,
    "cancel": "UPDATE demo_streams SET status = 'cancelled', version = version + 1,"
    " updated_at = now() WHERE id = %(id)s AND status <> 'cancelled' " + _RETURNING,
}

_TOKENS = ("USDC", "EURC", "XLM")
_ACCOUNTS = tuple(f"G{name.upper():A<7}" for name in ("alice", "bob", "carol", "dave", "erin"))
_ROLLBACK_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class Write:
    """One planned stream write. ``fails``: a business check fails after the enqueue."""

    seq: int
    op: str
    stream_id: str
    fails: bool = False
    sender: str = ""
    recipient: str = ""
    token: str = ""
    rate: int = 0


@dataclass(frozen=True, slots=True)
class Committed:
    """An event whose transaction committed: what the consumer must receive."""

    event_type: str
    payload: dict[str, Any]
    committed_at: float  # time.time() right after COMMIT returned


@dataclass
class Ledger:
    """What the writers did, for the display and the final check."""

    planned: int
    committed: dict[str, Committed] = field(default_factory=dict)
    rolled_back: set[str] = field(default_factory=set)  # delivery ids returned, then undone

    @property
    def written(self) -> int:
        return len(self.committed) + len(self.rolled_back)


class SimulatedFailure(Exception):
    """The business check that fails after the event was enqueued: rolls the write back."""

    def __init__(self, delivery_id: str) -> None:
        super().__init__("simulated business failure")
        self.delivery_id = delivery_id


class UnexpectedState(Exception):
    """A planned write found its stream in another state: a bug in the demo's plan."""


def plan(events: int, seed: int) -> list[Write]:
    """A deterministic sequence of ``events`` writes for ``seed``.

    About one write in twenty (at least one, from two writes on) fails after its enqueue.
    A failed write changes nothing, so the plan keeps the state it had.
    """
    rng = random.Random(seed)
    share = max(1, round(events * _ROLLBACK_SHARE)) if events >= 2 else 0
    failing = set(rng.sample(range(events), share))
    status: dict[str, str] = {}
    next_id = 0
    writes: list[Write] = []
    for seq in range(events):
        fails = seq in failing
        live = [s for s, st in status.items() if st != "cancelled"]
        if len(live) < 3 or rng.random() < 0.25:
            next_id += 1
            stream_id = f"{STREAM_PREFIX}{next_id:05d}"
            sender, recipient = rng.sample(_ACCOUNTS, 2)
            writes.append(
                Write(
                    seq,
                    "create",
                    stream_id,
                    fails,
                    sender=sender,
                    recipient=recipient,
                    token=rng.choice(_TOKENS),
                    rate=rng.randrange(1, 10_000),
                )
            )
            if not fails:
                status[stream_id] = "active"
            continue
        stream_id = rng.choice(live)
        if status[stream_id] == "active":
            op = rng.choices(("update", "pause", "cancel"), weights=(5, 3, 1))[0]
        else:
            op = rng.choices(("update", "cancel"), weights=(3, 1))[0]
        writes.append(Write(seq, op, stream_id, fails, rate=rng.randrange(1, 10_000)))
        if not fails:
            status[stream_id] = {"update": "active", "pause": "paused", "cancel": "cancelled"}[op]
    return writes


def shard(writes: list[Write], writers: int) -> list[list[Write]]:
    """Split the plan between ``writers``; all writes of one stream go to one writer, in
    order, so concurrent writers never race on a stream."""
    shards: list[list[Write]] = [[] for _ in range(writers)]
    for write in writes:
        number = int(write.stream_id.removeprefix(STREAM_PREFIX))
        shards[number % writers].append(write)
    return [s for s in shards if s]


async def prepare(conn: psycopg.AsyncConnection[Any]) -> None:
    """Create ``demo_streams`` if missing; clear the demo's rows of an earlier run.

    Only the demo's own rows go: ``demo_streams`` and the outbox and dead-letter rows of
    its streams. Runs in one transaction.
    """
    async with conn.transaction():
        await conn.execute(SCHEMA)
        await conn.execute("DELETE FROM demo_streams")
        await conn.execute(
            "DELETE FROM webhook_outbox WHERE starts_with(stream_id, %s)", (STREAM_PREFIX,)
        )
        await conn.execute(
            "DELETE FROM webhook_dead_letter WHERE starts_with(stream_id, %s)", (STREAM_PREFIX,)
        )


async def apply(conn: psycopg.AsyncConnection[Any], write: Write) -> tuple[str, Committed]:
    """Run one write and enqueue its event in one transaction.

    Returns the delivery id and what was committed. Raises :class:`SimulatedFailure` (after
    the rollback) for a failing write.
    """
    async with conn.transaction():
        cur = await conn.execute(
            _SQL[write.op],
            {
                "id": write.stream_id,
                "sender": write.sender,
                "recipient": write.recipient,
                "token": write.token,
                "rate": write.rate,
            },
        )
        row = await cur.fetchone()
        if row is None:
            raise UnexpectedState(
                f"{write.op} {write.stream_id}: the stream is not in the planned state"
            )
        payload = {
            "id": row[0],
            "sender": row[1],
            "recipient": row[2],
            "token": row[3],
            "rate_per_second": int(row[4]),
            "status": row[5],
            "version": int(row[6]),
            "updated_at": row[7].isoformat(),
        }
        event_type = EVENTS[write.op]
        delivery_id = await enqueue(
            conn, stream_id=write.stream_id, event_type=event_type, payload=payload
        )
        if write.fails:
            # Raised inside the transaction block: the stream write and the event roll back.
            raise SimulatedFailure(delivery_id)
    return delivery_id, Committed(event_type, payload, time.time())


async def run_writer(
    conninfo: str,
    writes: list[Write],
    ledger: Ledger,
    *,
    start: float,
    rate: float,
) -> None:
    """Apply ``writes`` in order on one connection; write ``seq`` starts no earlier than
    ``start + seq / rate`` (``rate`` 0: as fast as possible)."""
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        for write in writes:
            if rate > 0:
                delay = start + write.seq / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            try:
                delivery_id, committed = await apply(conn, write)
            except SimulatedFailure as failure:
                ledger.rolled_back.add(failure.delivery_id)
                continue
            ledger.committed[delivery_id] = committed
