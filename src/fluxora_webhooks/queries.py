"""The named SQL blocks of ``sql/queries.sql`` (the outbox), ``sql/endpoints.sql`` (the
endpoint registry), ``sql/inbox.sql`` (the consumer's inbox), ``sql/tokens.sql`` (the API's
tokens and sessions), ``sql/deliveries.sql`` (events, deliveries and statistics for the
API) and ``sql/tools.sql`` (``send``, ``tail`` and the per-endpoint health), loaded once;
and :func:`session_lock`, the advisory lock by which instances take turns at a task."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable, Mapping
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


def parse_blocks(text: str) -> dict[str, str]:
    """Split a file of ``-- name: x`` blocks into {name: sql}."""
    blocks: dict[str, str] = {}
    matches = list(_NAME.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip()
        blocks[match.group(1)] = body.rstrip(";").strip()
    return blocks


_FILES = (
    "sql/queries.sql",
    "sql/endpoints.sql",
    "sql/inbox.sql",
    "sql/tokens.sql",
    "sql/deliveries.sql",
    "sql/tools.sql",
)


_USE = re.compile(r"^([ \t]*)--\s*use:\s*(\w+)\s*$", re.MULTILINE)


def expand_uses(blocks: dict[str, str], swap: Mapping[str, str] | None = None) -> dict[str, str]:
    """Replace each ``-- use: x`` line with block ``x`` (a fragment two statements share,
    such as the fan-out's INSERT), indented as the line; ``swap`` {x: y}: block ``y``
    where a line names ``x``."""
    swap = swap or {}

    def use(match: re.Match[str]) -> str:
        indent, name = match.group(1), match.group(2)
        name = swap.get(name, name)
        assert name in blocks, f"-- use: {name}: no such block"
        return "\n".join(indent + line if line else line for line in blocks[name].splitlines())

    expanded = {}
    for name, body in blocks.items():
        for _ in range(4):  # a fragment may use another
            body, found = _USE.subn(use, body)
            if not found:
                break
        expanded[name] = body
    return expanded


@cache
def _raw() -> dict[str, str]:
    blocks: dict[str, str] = {}
    for name in _FILES:
        text = resources.files("fluxora_webhooks").joinpath(name).read_text("utf-8")
        found = parse_blocks(text)
        assert not found.keys() & blocks.keys(), f"duplicate block names in {name}"
        blocks.update(found)
    return blocks


@cache
def _all() -> dict[str, str]:
    return expand_uses(_raw())


def query(name: str) -> str:
    """The SQL of the named block."""
    return _all()[name]


@cache
def variant(name: str, *swaps: tuple[str, str]) -> str:
    """The named block with each ``-- use: <use>`` fragment of ``swaps`` ((use, instead)
    pairs) replaced by block ``instead`` (forms of one statement without copies of it)."""
    raw = _raw()
    for _, instead in swaps:
        assert instead in raw, f"{instead}: no such block"
    return expand_uses(raw, dict(swaps))[name]


_PARAM = re.compile(r"%\((\w+)\)s")


@cache
def native(name: str, *swaps: tuple[str, str]) -> tuple[str, tuple[str, ...]]:
    """The named block (``swaps``: (use, instead) pairs, its :func:`variant`) with
    PostgreSQL's own ``$n`` placeholders instead of ``%(name)s``, and the parameter names
    in ``$n`` order, for a :class:`psycopg.AsyncRawCursor`.

    psycopg parses a ``%(name)s`` query on every execution when it is longer than its
    cache takes (4 KiB); the batch's completion statement is, and its parse cost more than
    the statement's own round trip. Converted once here, it is sent as it is."""
    sql = variant(name, *swaps) if swaps else query(name)
    lines = (line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    text = "\n".join(lines)
    assert "%%" not in text, f"{name}: a literal % has no native form here"
    order: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        return f"${order.setdefault(match.group(1), len(order) + 1)}"

    return _PARAM.sub(number, text), tuple(order)


@contextlib.asynccontextmanager
async def session_lock(
    conn: psycopg.AsyncConnection[Any],
    key: int,
    *,
    wait: bool = False,
    on_wait: Callable[[], None] | None = None,
) -> AsyncIterator[bool]:
    """A session advisory lock on ``key`` for the block: yields whether it is held. Taken
    at once or not at all; with ``wait``, waited for (``on_wait`` is called first when
    another holds it). Released at the end (a broken connection releases it anyway)."""
    import psycopg

    cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
    row = await cur.fetchone()
    held = bool(row and row[0])
    if not held and wait:
        if on_wait is not None:
            on_wait()
        await conn.execute("SELECT pg_advisory_lock(%s)", (key,))
        held = True
    try:
        yield held
    finally:
        if held and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
