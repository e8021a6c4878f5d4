"""Debian's Chromium, driven by Playwright: the browser of the dashboard's tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, async_playwright

CHROMIUM = Path("/usr/bin/chromium")
HAVE_CHROMIUM = CHROMIUM.exists()  # once, at import: no file check in the event loop
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@contextlib.asynccontextmanager
async def chromium(*extra: str) -> AsyncIterator[Browser]:
    """A launched browser (``extra``: more command-line switches), closed on the way out;
    a test fails (never skips) without it."""
    if not HAVE_CHROMIUM:
        pytest.fail("Debian's chromium is not installed (apt-get install chromium)")
    async with async_playwright() as pw:
        launched = await pw.chromium.launch(executable_path=str(CHROMIUM), args=[*ARGS, *extra])
        try:
            yield launched
        finally:
            await launched.close()
