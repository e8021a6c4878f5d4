"""Text from the database or a consumer, made safe to show on an operator's terminal.

Stored text (event types, stream ids, errors, response bodies) is data: it is shown as it
is, never read as rich markup (``[bold]``, ``[link=...]``), and the characters a terminal
would act on are made visible instead of being passed through: C0 and C1 controls (so
``ESC [`` and ``ESC ]`` sequences), DEL, bidirectional overrides and every other
non-printable character appear as ``\\x1b``, ``\\u202e``, ... Fields in tables are bounded
in width; ``--json`` output keeps the full data (JSON escapes these characters itself).
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from rich.text import Text

if TYPE_CHECKING:
    from rich.console import Console

ELLIPSIS = "…"


def visible(text: str) -> str:
    """``text`` with every non-printable character written as its escape (``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def bounded(text: str, width: int | None) -> str:
    """``text`` cut to ``width`` characters, the last one an ellipsis when cut."""
    if width is None or len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + ELLIPSIS


def cell(value: Any, width: int | None = None) -> Text:
    """A table cell or a line of output from stored text: literal (no markup), control
    characters visible, at most ``width`` characters. A time is ISO 8601 to the second with
    its offset, as every command shows times (not ``str``'s space and microseconds)."""
    if isinstance(value, datetime):
        text = value.isoformat(timespec="seconds")
    else:
        text = "" if value is None else str(value)
    return Text(bounded(visible(text), width))


def console(**options: Any) -> Console:
    """A rich console for a command's output (``options`` are rich's) whose reader going
    away (``... | head``) raises :class:`BrokenPipeError`, which the command line ends
    quietly with exit 0 as it does for any other output (rich's own handling exits 1)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return _Console(**options)
