"""Opaque cursors for keyset pagination: the last key of a page, encoded with the list it
belongs to, so a cursor of one list is refused by another (400). Never an OFFSET."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Query

from .errors import ApiError

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_KEY = 2**63 - 1  # the keys are bigint ids

# A list's paging parameters, as the document describes them.
Limit = Annotated[
    int, Query(ge=1, le=MAX_LIMIT, description=f"items per page (default {DEFAULT_LIMIT})")
]
Cursor = Annotated[
    str | None,
    Query(description="`next_cursor` of the previous page (absent or empty: the first page)"),
]


def encode(kind: str, key: str | int) -> str:
    return base64.urlsafe_b64encode(f"{kind}:{key}".encode()).decode().rstrip("=")


def page(kind: str, data: Sequence[Any], last: str | int | None) -> dict[str, Any]:
    """A page of ``kind``: its items and the cursor of the next page (None: the last)."""
    return {"data": data, "next_cursor": None if last is None else encode(kind, last)}


def decode(kind: str, cursor: str | None) -> str | None:
    """The key in ``cursor`` (None for the first page), or 400 for a cursor that is not
    one of this list's."""
    if cursor is None or cursor == "":
        return None
    try:
        # validate: characters outside the alphabet (a NUL, a space) refuse the cursor,
        # not skipped to read as another one.
        padded = cursor + "=" * (-len(cursor) % 4)
        text = base64.b64decode(padded, altchars=b"-_", validate=True).decode()
    except (binascii.Error, ValueError):
        text = ""
    found, sep, key = text.partition(":")
    # No key we return holds a control character (a NUL could not even be looked up).
    if found != kind or not sep or not key or not key.isprintable():
        raise ApiError(400, "invalid_cursor", "the cursor is not one this list returned")
    return key


def decode_int(kind: str, cursor: str | None) -> int | None:
    key = decode(kind, cursor)
    if key is None:
        return None
    if not key.isascii() or not key.isdigit() or len(key) > 19 or int(key) > MAX_KEY:
        raise ApiError(400, "invalid_cursor", "the cursor is not one this list returned")
    return int(key)
