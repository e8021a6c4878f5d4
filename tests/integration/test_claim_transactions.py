"""A claim loop's transactions: a batch that claimed rows commits and begins the loop's next
transaction in one message (``COMMIT; BEGIN``); a loop with nothing to claim leaves no
transaction open while it waits. (A commit that fails leaves the connection usable for
the batch's recording row by row: test_outcomes.py, a lease rejected at COMMIT.)"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.dispatch import (
    enqueue_many,
    make_settings,
    rows,
    running_dispatcher,
    scalar,
    wait_until,
)
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

# Longer than a batch into a local receiver lasts, shorter than the poll interval (200 ms).
LINGERING = "100 milliseconds"


async def _lingering(database_url: str) -> list[tuple[object, ...]]:
    """The database's connections idle in a transaction for longer than LINGERING."""
    return await rows(
        database_url,
        "SELECT pid, query FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND state = 'idle in transaction'"
        f" AND state_change < clock_timestamp() - interval '{LINGERING}'",
    )


async def _none_pending(database_url: str) -> bool:
    left = await scalar(database_url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed")
    return int(left) == 0


async def test_an_idle_claim_loop_leaves_no_transaction_open(
    database_url: str, receiver: Receiver
) -> None:
    """Monitoring flags a connection idle in a transaction, and
    ``idle_in_transaction_session_timeout`` ends it: the transaction a batch begins for the
    next claim is ended by that claim when it finds nothing."""
    await enqueue_many(database_url, 120)
    settings = make_settings(receiver.url, claim_loops=3)
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(120)
        await wait_until(lambda: _none_pending(database_url), what="every row recorded")
        # Several polls of each loop, looked at between and across them.
        seen = []
        for _ in range(12):
            await asyncio.sleep(0.05)
            seen += await _lingering(database_url)
        assert seen == []
        # Still claiming: a row enqueued now is delivered.
        await enqueue_many(database_url, 1)
        await receiver.wait_for(121)
