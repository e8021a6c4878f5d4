"""Issue 18 (defects 3 and 8): the longest periods and largest limits the settings and the
commands accept fit what PostgreSQL's intervals, timestamps and bigints hold; one past them
is refused before PostgreSQL sees it."""

from __future__ import annotations

import psycopg
import pytest

from fluxora_webhooks import deadletters, retention
from fluxora_webhooks.commands.dlq import MAX_LIST_LIMIT
from fluxora_webhooks.commands.status import MAX_MINUTES
from fluxora_webhooks.ops import read_recent_outcomes
from fluxora_webhooks.settings import MAX_DURATION_MS

pytestmark = pytest.mark.integration


async def test_the_longest_periods_accepted_fit_postgresql(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        result = await retention.prune(conn, older_than_ms=MAX_DURATION_MS, dead_letters=True)
        assert result.cutoff is not None and result.outbox_rows == 0
        await read_recent_outcomes(conn, MAX_MINUTES * 60_000)
        with pytest.raises(ValueError, match="100 years"):
            # 99999999999999d: PostgreSQL's DatetimeFieldOverflow on every run, before.
            await retention.prune(conn, older_than_ms=99_999_999_999_999 * 86_400_000)
    assert await deadletters.list_dead(database_url, limit=MAX_LIST_LIMIT) == []
