"""The end-to-end tests' shared fixtures: the dashboard's browser."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from playwright.async_api import Browser

from tests.support.browser import chromium


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    """Debian's Chromium, one launch per test module."""
    async with chromium() as launched:
        yield launched
