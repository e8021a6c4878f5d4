"""Reading a service's ``/metrics`` from outside, as Prometheus does, and its health
endpoints as an orchestrator does."""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(port: int, path: str = "/metrics") -> Samples:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"http://127.0.0.1:{port}{path}", timeout=aiohttp.ClientTimeout(total=10)
        ) as resp,
    ):
        assert resp.status == 200, resp.status
        text = await resp.text()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


async def get_json(port: int, path: str) -> tuple[int, Any]:
    """A health endpoint's status and JSON body; (0, None) while nothing answers."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"http://127.0.0.1:{port}{path}", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp,
        ):
            return resp.status, await resp.json()
    except aiohttp.ClientError:
        return 0, None


async def is_ready(port: int) -> bool:
    """Whether ``/readyz`` answers 200 (for ``wait_until``)."""
    return (await get_json(port, "/readyz"))[0] == 200
