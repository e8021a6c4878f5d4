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


async def replay_or_purge(
    database_url: str, action: str, keys: Sequence[str], *, include_all: bool = False
) -> tuple[list[str], list[str]]:
    """``action`` is replay (back into the outbox, due now, same delivery id) or purge
    (kept as 'purged' until ``prune`` removes it). Returns (delivery ids done, the keys
    that matched no waiting dead letter)."""
    async with await psycopg.AsyncConnection.connect(database_url) as conn, conn.transaction():
        cur = await conn.execute(query(f"dlq_{action}"), {"keys": list(keys), "all": include_all})
        found = [(str(r[0]), str(r[1])) for r in await cur.fetchall()]
    matched = {k for pair in found for k in pair}
    return [d for d, _ in found], [k for k in keys if k not in matched]


async def replay(database_url: str, keys: Sequence[str], *, include_all: bool = False) -> list[str]:
    """Put dead letters back into the outbox, due now, with their delivery id."""
    return (await replay_or_purge(database_url, "replay", keys, include_all=include_all))[0]


async def purge(database_url: str, keys: Sequence[str], *, include_all: bool = False) -> list[str]:
    """Discard dead letters (kept as 'purged' until ``prune`` removes them)."""
    return (await replay_or_purge(database_url, "purge", keys, include_all=include_all))[0]
