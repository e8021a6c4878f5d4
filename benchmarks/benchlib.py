"""What the benchmark's processes share: the event body, the request headers, small helpers.

Every contender sends the same bytes: a JSON body of about ``BODY_BYTES`` and the ten
headers our dispatcher sends, so the raw HTTP limit and the peer are measured on the same
request as ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import urllib.request
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

BODY_BYTES = 256
PAD = "x" * 160


def event_payload(seq: int, t0: float | None = None) -> dict[str, Any]:
    """The payload of one benchmark event (about BODY_BYTES once stored as jsonb text)."""
    payload: dict[str, Any] = {"kind": "bench", "seq": seq, "pad": PAD}
    if t0 is not None:
        payload["t0"] = t0
    return payload


def body_bytes(seq: int = 0) -> bytes:
    return json.dumps(event_payload(seq), separators=(", ", ": ")).encode()


def raw_headers(body: bytes) -> dict[str, str]:
    """Ten headers of the same names and sizes as a signed fluxora request."""
    return {
        "content-type": "application/json",
        "user-agent": "fluxora-webhooks/0.1.0",
        "x-fluxora-delivery-id": "6f1c2a3e-8d4b-4e5f-9a0b-1c2d3e4f5a6b",
        "x-fluxora-event": "bench.event",
        "x-fluxora-timestamp": str(int(time.time())),
        "x-fluxora-signature": "0" * 64,
        "x-fluxora-attempt": "1",
        "webhook-id": "6f1c2a3e-8d4b-4e5f-9a0b-1c2d3e4f5a6b",
        "webhook-timestamp": str(int(time.time())),
        "webhook-signature": "v1," + "A" * 43 + "=",
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_json(url: str, method: str = "GET", timeout: float = 5.0) -> Any:
    """A blocking request to a control endpoint of our own receiver (loopback only)."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


async def ahttp_json(url: str, method: str = "GET", timeout: float = 5.0) -> Any:
    return await asyncio.to_thread(http_json, url, method, timeout)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop, like ``fluxora-webhooks run`` does."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def dig(out: dict[str, Any], *path: str) -> Any:
    """``out[path[0]][path[1]]...``, or None where a key is missing (a section not run)."""
    node: Any = out
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (/proc; a PostgreSQL backend's
    by ``conn.info.backend_pid``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def keep(results: str, prefix: str, payload: dict[str, Any]) -> Path:
    """Save ``payload`` as ``<results>/<prefix>-<timestamp>.json``, print and return where."""
    out = Path(results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / time.strftime(f"{prefix}-%Y%m%d-%H%M%S.json")
    path.write_text(json.dumps(payload, indent=1))
    print(f"saved {path}")
    return path


@contextlib.contextmanager
def scratch_database(admin_url: str, name: str) -> Iterator[str]:
    """A database of its own for one benchmark on ``admin_url``'s server: dropped first if it
    exists, yielded as a connection string, and dropped again at the end, also on error.
    Never one of the server's own databases, nor the one ``admin_url`` names."""
    import psycopg
    from psycopg import sql

    ident = sql.Identifier(name)
    with psycopg.connect(admin_url, autocommit=True) as admin:
        if name in ("postgres", "template0", "template1", admin.info.dbname):
            raise SystemExit(f"--database {name}: not a scratch database")
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(ident))
        try:
            yield psycopg.conninfo.make_conninfo(admin.info.dsn, dbname=name)
        finally:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
            print(f"dropped {name}")
