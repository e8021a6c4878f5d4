"""The raw HTTP limit: a plain aiohttp client with keep-alive, on uvloop like our dispatcher,
blasting the receiver with the same body size and header count.

``--concurrency`` workers share one session (a connector bounded to that many
connections); each POSTs, reads the response and POSTs again, ``--requests`` in all.
Prints one JSON line: requests, seconds, rate (client side).

    python benchmarks/rawhttp.py --url http://127.0.0.1:8080/raw --requests 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import body_bytes, raw_headers, run


async def blast(url: str, requests: int, concurrency: int) -> dict[str, float]:
    body = body_bytes()
    headers = raw_headers(body)
    left = requests
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal left, errors
            while left > 0:
                left -= 1
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    if response.status != 200:
                        errors += 1

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {
        "requests": requests,
        "concurrency": concurrency,
        "seconds": elapsed,
        "rate": requests / elapsed,
        "errors": errors,
        "cpu_s": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=50)
    args = parser.parse_args()
    result = run(blast(args.url, args.requests, args.concurrency))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
