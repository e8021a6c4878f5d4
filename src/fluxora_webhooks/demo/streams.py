"""The demo's payment-streams write path.

A stream pays ``rate_per_second`` of a token from a sender to a recipient, for one tenant
(a customer of the application). Four operations change it (create, update, pause,
cancel), and each one writes the stream and enqueues its ``stream.*`` event for the
stream's tenant in **one transaction**, the way an application uses the outbox. Some writes
fail a (simulated) business check *after* the event was enqueued: the transaction rolls
back, and the event must never reach any consumer.

The demo owns what is named :data:`STREAM_PREFIX`: the table ``demo_streams``, the tenants
``fluxora-demo-*`` and their endpoints, every outbox and dead-letter row of its streams and
tenants, and the operator events about them (:data:`OWNED`); it clears exactly those at the
start of a run and touches nothing else.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ..outbox import enqueue
from .consumer import EventKey, event_key

STREAM_PREFIX = "fluxora-demo-"
TENANT_PREFIX = STREAM_PREFIX

# The outbox and dead-letter rows the demo owns: its streams', its tenants', and the
# operator events about its tenants' endpoints and deliveries. One parameter: %(prefix)s.
OWNED = (
    "(starts_with(stream_id, %(prefix)s) OR starts_with(tenant, %(prefix)s)"
    " OR (tenant = '!operator' AND starts_with(payload->>'tenant', %(prefix)s)))"
)

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
    tenant: str = ""
    sender: str = ""
    recipient: str = ""
    token: str = ""
    rate: int = 0


@dataclass(frozen=True, slots=True)
class Committed:
    """An event whose transaction committed: what the consumers must receive."""

    tenant: str
    event_type: str
    payload: dict[str, Any]
    committed_at: float  # time.time() right after COMMIT returned
    step: int = 0  # the demo step that wrote it

    @property
    def key(self) -> EventKey:
        return event_key(self.event_type, self.payload)

    @property
    def stream_id(self) -> str:
        return str(self.payload["id"])


@dataclass
class Ledger:
    """What the writers did, for the display and the checks."""

    planned: int = 0
    committed: dict[EventKey, Committed] = field(default_factory=dict)
    rolled_back: set[EventKey] = field(default_factory=set)  # enqueued, then undone

    @property
    def written(self) -> int:
        return len(self.committed) + len(self.rolled_back)


class SimulatedFailure(Exception):
    """The business check that fails after the event was enqueued: rolls the write back."""

    def __init__(self, key: EventKey) -> None:
        super().__init__("simulated business failure")
        self.key = key


class UnexpectedState(Exception):
    """A planned write found its stream in another state: a bug in the demo's plan."""


def plan(events: int, seed: int, tenants: Sequence[str] = ("",)) -> list[Write]:
    """A deterministic sequence of ``events`` writes for ``seed``.

    The writes go to the tenants in turn (write ``seq`` to ``tenants[seq % len]``), so any
    run of consecutive writes touches every tenant. About one write in twenty (at least one,
    from two writes on) fails after its enqueue. A failed write changes nothing, so the plan
    keeps the state it had.
    """
    rng = random.Random(seed)
    share = max(1, round(events * _ROLLBACK_SHARE)) if events >= 2 else 0
    failing = set(rng.sample(range(events), share))
    status: dict[str, str] = {}
    owner: dict[str, str] = {}
    next_id = 0
    writes: list[Write] = []
    for seq in range(events):
        fails = seq in failing
        tenant = tenants[seq % len(tenants)]
        live = [s for s, st in status.items() if st != "cancelled" and owner[s] == tenant]
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
                    tenant=tenant,
                    sender=sender,
                    recipient=recipient,
                    token=rng.choice(_TOKENS),
                    rate=rng.randrange(1, 10_000),
                )
            )
            if not fails:
                status[stream_id] = "active"
                owner[stream_id] = tenant
            continue
        stream_id = rng.choice(live)
        if status[stream_id] == "active":
            op = rng.choices(("update", "pause", "cancel"), weights=(5, 3, 1))[0]
        else:
            op = rng.choices(("update", "cancel"), weights=(3, 1))[0]
        writes.append(
            Write(seq, op, stream_id, fails, tenant=tenant, rate=rng.randrange(1, 10_000))
        )
        if not fails:
            status[stream_id] = {"update": "active", "pause": "paused", "cancel": "cancelled"}[op]
    return writes


def burst(
    tenant: str, *, streams: int, updates: int, first_seq: int, first_stream: int, seed: int
) -> list[Write]:
    """New streams of one tenant, each created and then updated ``updates`` times, the
    streams' writes interleaved (none fails): the ordering step's traffic."""
    rng = random.Random(seed)
    ids = [f"{STREAM_PREFIX}{first_stream + i:05d}" for i in range(streams)]
    writes: list[Write] = []
    for round_ in range(updates + 1):
        for stream_id in ids:
            seq = first_seq + len(writes)
            if round_ == 0:
                sender, recipient = rng.sample(_ACCOUNTS, 2)
                writes.append(
                    Write(
                        seq,
                        "create",
                        stream_id,
                        tenant=tenant,
                        sender=sender,
                        recipient=recipient,
                        token=rng.choice(_TOKENS),
                        rate=rng.randrange(1, 10_000),
                    )
                )
            else:
                writes.append(
                    Write(seq, "update", stream_id, tenant=tenant, rate=rng.randrange(1, 10_000))
                )
    return writes


def last_stream(writes: Sequence[Write]) -> int:
    """The highest stream number of these writes (0 for none)."""
    return max((int(w.stream_id.removeprefix(STREAM_PREFIX)) for w in writes), default=0)


def shard(writes: list[Write], writers: int) -> list[list[Write]]:
    """Split the plan between ``writers``; all writes of one stream go to one writer, in
    order, so concurrent writers never race on a stream."""
    shards: list[list[Write]] = [[] for _ in range(writers)]
    for write in writes:
        number = int(write.stream_id.removeprefix(STREAM_PREFIX))
        shards[number % writers].append(write)
    return [s for s in shards if s]


async def prepare(conn: psycopg.AsyncConnection[Any]) -> None:
    """Create ``demo_streams`` if missing; clear what an earlier run left.

    Only the demo's own rows go (see the module's docstring): ``demo_streams``, the outbox
    and dead-letter rows it owns (:data:`OWNED`) and its tenants' endpoints. Runs in one
    transaction.
    """
    owned = {"prefix": STREAM_PREFIX}
    async with conn.transaction():
        await conn.execute(SCHEMA)
        await conn.execute("DELETE FROM demo_streams")
        await conn.execute(f"DELETE FROM webhook_outbox WHERE {OWNED}", owned)
        await conn.execute(f"DELETE FROM webhook_dead_letter WHERE {OWNED}", owned)
        await conn.execute(
            "DELETE FROM webhook_endpoints WHERE starts_with(tenant, %s)", (TENANT_PREFIX,)
        )


async def apply(conn: psycopg.AsyncConnection[Any], write: Write, step: int = 0) -> Committed:
    """Run one write and enqueue its event in one transaction; what was committed. Raises
    :class:`SimulatedFailure` (after the rollback) for a failing write."""
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
        await enqueue(
            conn,
            tenant=write.tenant,
            stream_id=write.stream_id,
            event_type=event_type,
            payload=payload,
        )
        if write.fails:
            # Raised inside the transaction block: the stream write and the event roll back.
            raise SimulatedFailure(event_key(event_type, payload))
    return Committed(write.tenant, event_type, payload, time.time(), step)


async def run_writer(
    conninfo: str,
    writes: list[Write],
    ledger: Ledger,
    *,
    start: float,
    rate: float,
    step: int = 0,
) -> None:
    """Apply ``writes`` in order on one connection; write ``seq`` starts no earlier than
    ``start + seq / rate`` (``rate`` 0: as fast as possible)."""
    if not writes:
        return
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        for write in writes:
            if rate > 0:
                delay = start + write.seq / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            try:
                committed = await apply(conn, write, step)
            except SimulatedFailure as failure:
                ledger.rolled_back.add(failure.key)
                continue
            ledger.committed[committed.key] = committed
