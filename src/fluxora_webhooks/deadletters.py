"""Dead letters: list, show, replay (same delivery id) and purge."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .queries import query


async def list_dead(
    database_url: str, *, limit: int = 100, include_all: bool = False
) -> list[dict[str, Any]]:
    """Dead letters, newest first (only those still dead unless ``include_all``)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(query("dlq_list"), {"all": include_all, "limit": limit})
        return list(await cur.fetchall())


async def show(database_url: str, key: str) -> list[dict[str, Any]]:
    """Every dead letter of a delivery id (or the one with that row id)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(query("dlq_show"), {"key": key})
        return list(await cur.fetchall())


async def _act(database_url: str, name: str, keys: Sequence[str], include_all: bool) -> list[str]:
    async with await psycopg.AsyncConnection.connect(database_url) as conn, conn.transaction():
        cur = await conn.execute(query(name), {"keys": list(keys), "all": include_all})
        return [str(r[0]) for r in await cur.fetchall()]


async def replay(database_url: str, keys: Sequence[str], *, include_all: bool = False) -> list[str]:
    """Put dead letters back into the outbox, due now, with their delivery id."""
    return await _act(database_url, "dlq_replay", keys, include_all)


async def purge(database_url: str, keys: Sequence[str], *, include_all: bool = False) -> list[str]:
    """Discard dead letters (kept as 'purged' until ``prune`` removes them)."""
    return await _act(database_url, "dlq_purge", keys, include_all)
