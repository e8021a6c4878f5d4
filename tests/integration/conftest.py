"""What several integration tests of the API share (a module's own fixture of the same name
takes its place)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from tests.support.api import Api, serving


@pytest_asyncio.fixture
async def api(database_url: str, redis_url: str, prefix: str) -> AsyncIterator[Api]:
    """The API served on loopback, its Redis the tests' (breaker states under ``prefix``)."""
    async with serving(database_url, redis_url, prefix) as running:
        yield running
