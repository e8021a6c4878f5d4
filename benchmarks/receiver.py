"""A fast, honest HTTP/1.1 receiver for the benchmark: its own process, uvloop, no framework.

Every request is parsed (request line, every header, a Content-Length body) and answered
``200`` with keep-alive; nothing is skipped that a real consumer's server would do before
its handler runs. It counts receipts and keeps the first and last receipt time, so a run's
rate is measured where the events arrive. ``POST /latency`` also reads ``t0`` (the
producer's commit time, unix seconds) from the JSON body and records ``now - t0``.

For the many-endpoint benchmark (``many.py``), every request path is its own endpoint:
receipts are counted per path; ``POST /ordered...`` reads ``stream`` and ``seq`` from the
body and counts a receipt that comes before an earlier one of its stream (per path) as out
of order, answers 503 while the body's ``fail_until`` (unix seconds) is ahead (not a
receipt), and records ``now - t0`` when the body has ``t0`` (apart for events marked
``watch``); ``POST /hang...`` is read and never answered (the consumer that hangs until the
sender's timeout), counted apart and not as a receipt; ``POST /spare...`` is answered and
counted apart too (endpoints in the place of the hanging ones, for an all-healthy run).

Control endpoints (loopback, used by ``run.py``): ``GET /_stats``, ``POST /_reset``.

    python benchmarks/receiver.py --port 0     # prints "PORT <n>" once listening
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import run

MAX_HEAD = 64 * 1024
OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
OK_CLOSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n"
    b"Connection: close\r\n\r\nok"
)
UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class Stats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.bytes = 0
        self.latencies_ms: list[float] = []
        self.bad_latency = 0
        self.connections = 0  # opened since the reset: keep-alive keeps this small
        self.paths: dict[str, int] = {}
        self.hung = 0
        self.spare = 0  # answered, counted apart (the endpoints that would hang)
        self.last_seq: dict[tuple[str, str], int] = {}
        self.out_of_order = 0
        self.repeats = 0
        self.refused = 0  # 503s of /ordered requests carrying a future fail_until
        self.watched_ms: list[float] = []  # latencies of /ordered events marked "watch"

    def as_json(self) -> bytes:
        return json.dumps(
            {
                "count": self.count,
                "first": self.first,
                "last": self.last,
                "bytes": self.bytes,
                "latencies_ms": self.latencies_ms,
                "bad_latency": self.bad_latency,
                "connections": self.connections,
                "paths": self.paths,
                "hung": self.hung,
                "spare": self.spare,
                "streams": len(self.last_seq),
                "out_of_order": self.out_of_order,
                "repeats": self.repeats,
                "refused": self.refused,
                "watched_ms": self.watched_ms,
            }
        ).encode()


STATS = Stats()


def _json_response(body: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class HttpProtocol(asyncio.Protocol):
    """One keep-alive connection: parse requests as they come, answer each in order."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: Any = None
        self.hung = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports are not asyncio.Transport subclasses
        STATS.connections += 1

    def data_received(self, data: bytes) -> None:
        if self.hung:
            return
        buf = self.buf
        buf += data
        transport = self.transport
        assert transport is not None
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    transport.write(BAD)
                    transport.close()
                return
            lines = buf[:end].decode("latin-1").split("\r\n")
            request_line = lines[0].split(" ")
            if len(request_line) != 3 or not request_line[2].startswith("HTTP/1."):
                transport.write(BAD)
                transport.close()
                return
            method, target, _ = request_line
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    transport.write(BAD)
                    transport.close()
                    return
                headers[name.strip().lower()] = value.strip()
            if "transfer-encoding" in headers:
                transport.write(BAD)  # the senders here always send Content-Length
                transport.close()
                return
            length = int(headers.get("content-length", "0"))
            total = end + 4 + length
            if len(buf) < total:
                return
            body = bytes(buf[end + 4 : total])
            del buf[:total]
            response = self.handle(method, target, body)
            if response is None:
                self.hung = True  # never answered: the sender gives up at its timeout
                return
            if headers.get("connection", "").lower() == "close":
                transport.write(OK_CLOSE if response is OK else response)
                transport.close()
                return
            transport.write(response)

    def handle(self, method: str, target: str, body: bytes) -> bytes | None:
        if target.startswith("/_"):
            if target.startswith("/_stats"):
                return _json_response(STATS.as_json())
            if target.startswith("/_reset") and method == "POST":
                STATS.reset()
                return _json_response(b"{}")
        now = time.time()
        stats = STATS
        path = target.partition("?")[0]
        stats.paths[path] = stats.paths.get(path, 0) + 1
        if target.startswith("/hang"):
            stats.hung += 1
            return None
        if target.startswith("/spare"):
            stats.spare += 1
            return OK
        if target.startswith("/ordered"):
            try:
                event = json.loads(body)
            except ValueError:
                event = {}
            if isinstance(event, dict) and now < float(event.get("fail_until", 0)):
                stats.refused += 1
                return UNAVAILABLE
        if not stats.count:
            stats.first = now
        stats.last = now
        stats.count += 1
        stats.bytes += len(body)
        if target.startswith("/latency"):
            try:
                t0 = float(json.loads(body)["t0"])
            except (ValueError, KeyError, TypeError):
                stats.bad_latency += 1
            else:
                stats.latencies_ms.append((now - t0) * 1000)
        elif target.startswith("/ordered"):
            self.check_order(path, body)
            if isinstance(event, dict) and "t0" in event:
                late = (now - float(event["t0"])) * 1000
                (stats.watched_ms if event.get("watch") else stats.latencies_ms).append(late)
        return OK

    @staticmethod
    def check_order(path: str, body: bytes) -> None:
        stats = STATS
        try:
            event = json.loads(body)
            key, seq = (path, str(event["stream"])), int(event["seq"])
        except (ValueError, KeyError, TypeError):
            stats.out_of_order += 1
            return
        last = stats.last_seq.get(key)
        if last is not None and seq < last:
            stats.out_of_order += 1
        elif last is not None and seq == last:
            stats.repeats += 1
        else:
            stats.last_seq[key] = seq


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(HttpProtocol, "127.0.0.1", port, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sock = server.sockets[0]
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    run(serve(args.port))


if __name__ == "__main__":
    main()
