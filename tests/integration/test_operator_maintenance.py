"""An operator's maintenance on the outbox while the dispatcher delivers (docs/operations.md,
"Restoring from a backup" and maintenance): what the dispatcher says, and that it goes on."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest

from fluxora_webhooks import dispatcher as dispatcher_module
from fluxora_webhooks import enqueue
from tests.support.dispatch import make_settings, running_dispatcher
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration


async def _logged(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if text in caplog.text:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never logged {text!r}:\n{caplog.text[-2000:]}")


async def test_a_claim_kept_out_by_an_operators_lock_says_so_not_database_unavailable(
    database_url: str,
    receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A VACUUM FULL, CLUSTER, ALTER TABLE, TRUNCATE or LOCK TABLE of the outbox holds an
    ACCESS EXCLUSIVE lock: the claim waits its lock_timeout (10 s; shortened here) and
    gives up. The database answered, so the log line says a lock was not granted and
    what usually holds it, not "database unavailable" (which sends an operator looking for
    an outage); when the lock goes, deliveries go on."""
    caplog.set_level(logging.INFO, logger="fluxora_webhooks")
    monkeypatch.setattr(dispatcher_module, "LOCK_TIMEOUT_MS", 300)
    settings = make_settings(receiver.url, poll_interval_ms=200, claim_loops=1)
    async with running_dispatcher(settings, database_url):
        async with await psycopg.AsyncConnection.connect(database_url) as operator:
            await operator.execute("LOCK TABLE webhook_outbox IN ACCESS EXCLUSIVE MODE")
            await _logged(caplog, "LockNotAvailable")
            await operator.rollback()
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            await enqueue(conn, stream_id="s", event_type="e", payload={"n": 1})
            await conn.commit()
        await receiver.wait_for(1, timeout=10)
    said = [r for r in caplog.records if "claim loop" in r.getMessage()]
    claim_lines = [r.getMessage() for r in said if r.levelno >= logging.WARNING]
    assert claim_lines
    for line in claim_lines:
        assert "database unavailable" not in line, line
        assert "another session holds the outbox" in line, line
        assert "VACUUM FULL" in line, line
    # And once the lock is gone, the loop says it claims again.
    assert any("claiming again (" in r.getMessage() for r in said if r.levelno == logging.INFO)
