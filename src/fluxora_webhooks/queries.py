"""The named SQL blocks of ``sql/queries.sql``, loaded once."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

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


@cache
def _all() -> dict[str, str]:
    text = resources.files("fluxora_webhooks").joinpath("sql/queries.sql").read_text("utf-8")
    return parse_blocks(text)


def query(name: str) -> str:
    """The SQL of the named block."""
    return _all()[name]
