"""Dead letters: list, show, replay (same delivery id) and purge.

The functions with a connection (``*_on``) are the admin layer the API calls; those taking
a database URL open one for the command line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .outbox import promote_after_commit
from .pgtypes import open_session
from .queries import query
from .settings import retry_rps


async def list_on(
    conn: psycopg.AsyncConnection[Any],
    *,
    limit: int = 100,
    include_all: bool = False,
    endpoint_id: str | None = None,
    tenant: str | None = None,
) -> list[dict[str, Any]]:
    """Dead letters, newest first (only those still dead unless ``include_all``), of one
    endpoint or tenant when given."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(
        query("dlq_list"),
        {"all": include_all, "limit": limit, "endpoint_id": endpoint_id, "tenant": tenant},
    )
    return list(await cur.fetchall())


async def replay_or_purge_on(
    conn: psycopg.AsyncConnection[Any],
    action: str,
    keys: Sequence[str],
    *,
    include_all: bool = False,
) -> tuple[list[str], list[str], list[str]]:
    """``action`` is replay (back into the outbox, same delivery id, an endpoint's due one
    after another at its retry rate, the first now) or purge
    (kept as 'purged' until ``prune`` removes it), in one transaction. Returns (delivery ids
    done, the keys that matched no waiting dead letter, the delivery ids replayed parked:
    their endpoint is disabled)."""
    async with conn.transaction():
        cur = await conn.execute(
            query(f"dlq_{action}"),
            {"keys": list(keys), "all": include_all, "rps": retry_rps(os.environ)},
        )
        rows = await cur.fetchall()
    if action == "replay":  # after the commit (docs/design.md, "Ordering")
        await promote_after_commit(conn, [(str(r[2]), str(r[3])) for r in rows if r[4]])
    found = [(str(r[0]), str(r[1])) for r in rows]
    matched = {k for pair in found for k in pair}
    parked = [str(r[0]) for r in rows if action == "replay" and r[5]]
    return [d for d, _ in found], [k for k in keys if k not in matched], parked


async def orphaned(
    database_url: str, keys: Sequence[str], *, include_all: bool = False
) -> list[tuple[str, str, str]]:
    """Waiting dead letters among ``keys`` (or all) that replay leaves where they are: their
    endpoint was removed. Returns (delivery id, row id, endpoint id) of each."""
    async with await open_session(database_url, autocommit=True) as conn:
        cur = await conn.execute(query("dlq_orphaned"), {"keys": list(keys), "all": include_all})
        return [(str(d), str(r), str(e)) for d, r, e in await cur.fetchall()]


async def list_dead(
    database_url: str,
    *,
    limit: int = 100,
    include_all: bool = False,
    endpoint_id: str | None = None,
    tenant: str | None = None,
) -> list[dict[str, Any]]:
    """:func:`list_on` on a connection of its own."""
    async with await open_session(database_url, autocommit=True) as conn:
        return await list_on(
            conn, limit=limit, include_all=include_all, endpoint_id=endpoint_id, tenant=tenant
        )


async def show(database_url: str, key: str) -> list[dict[str, Any]]:
    """Every dead letter of a delivery id (or the one with that row id)."""
    async with await open_session(database_url, autocommit=True) as conn:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(query("dlq_show"), {"key": key})
        return list(await cur.fetchall())


async def replay_or_purge(
    database_url: str, action: str, keys: Sequence[str], *, include_all: bool = False
) -> tuple[list[str], list[str], list[str]]:
    """:func:`replay_or_purge_on` on a connection of its own."""
    async with await open_session(database_url, autocommit=True) as conn:
        return await replay_or_purge_on(conn, action, keys, include_all=include_all)


async def replay(database_url: str, keys: Sequence[str], *, include_all: bool = False) -> list[str]:
    """Put dead letters back into the outbox, due now, with their delivery id."""
    return (await replay_or_purge(database_url, "replay", keys, include_all=include_all))[0]


async def purge(database_url: str, keys: Sequence[str], *, include_all: bool = False) -> list[str]:
    """Discard dead letters (kept as 'purged' until ``prune`` removes them)."""
    return (await replay_or_purge(database_url, "purge", keys, include_all=include_all))[0]
