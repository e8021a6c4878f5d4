"""A minimal webhook receiver: verify, de-duplicate by delivery id, answer fast.

    WEBHOOK_SECRET=... python examples/receiver.py --port 8080

Every request is verified with ``fluxora_webhooks.verify`` (either signature scheme), its
delivery id is checked against the ids already seen (the dispatcher delivers at least once,
so a delivery can arrive twice), and the event is queued for a background worker so that
the response goes back at once: a slow consumer would see retries it did not need.

Answers: 202 accepted, 200 for a duplicate (so the sender stops retrying it), 401 when
verification fails, 503 when the queue is full (the sender retries later).

The de-duplication here is in memory, for one process. A real consumer records the delivery
id durably (a table with a unique key, written in the transaction that handles the event)
before it answers 2xx.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from fluxora_webhooks.errors import VerificationError
from fluxora_webhooks.signing import verify

log = logging.getLogger("receiver")


@dataclass(frozen=True)
class Event:
    delivery_id: str
    event_type: str
    body: bytes


class SeenIds:
    """The most recent delivery ids, oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def add(self, delivery_id: str) -> bool:
        """Record an id; False if it was already there."""
        if delivery_id in self._ids:
            self._ids.move_to_end(delivery_id)
            return False
        self._ids[delivery_id] = None
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)
        return True

    def forget(self, delivery_id: str) -> None:
        self._ids.pop(delivery_id, None)


@dataclass
class Receiver:
    secret: str | bytes
    previous: str | bytes | None = None
    queue_size: int = 10_000
    seen: SeenIds = field(default_factory=lambda: SeenIds(100_000))
    processed: deque[Event] = field(default_factory=lambda: deque(maxlen=1000))
    duplicates: int = 0

    def __post_init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue(self.queue_size)

    async def receive(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            delivery_id = verify(body, request.headers, self.secret, previous=self.previous)
        except VerificationError as exc:
            log.info("rejected a webhook: %s", exc)
            return web.json_response({"error": exc.reason}, status=401)
        # No await between the check and the record: two copies arriving together cannot
        # both pass.
        if not self.seen.add(delivery_id):
            self.duplicates += 1
            return web.json_response({"status": "duplicate", "delivery_id": delivery_id})
        event = Event(delivery_id, request.headers.get("x-fluxora-event", ""), body)
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.seen.forget(delivery_id)  # not taken: the retry must not look like a duplicate
            return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "5"})
        return web.json_response({"status": "accepted", "delivery_id": delivery_id}, status=202)

    async def work(self) -> None:
        while True:
            event = await self.queue.get()
            try:
                await self.handle(event)
            except Exception:
                log.exception("handling delivery %s failed", event.delivery_id)
            finally:
                self.queue.task_done()

    async def handle(self, event: Event) -> None:
        """Your business logic goes here."""
        log.info("event %s (%s): %d bytes", event.delivery_id, event.event_type, len(event.body))
        self.processed.append(event)


RECEIVER = web.AppKey("receiver", Receiver)


def make_app(
    secret: str | bytes, previous: str | bytes | None = None, *, queue_size: int = 10_000
) -> web.Application:
    """The receiver as an aiohttp application; ``app[RECEIVER]`` holds its state."""
    receiver = Receiver(secret, previous, queue_size)
    app = web.Application()
    app[RECEIVER] = receiver
    app.router.add_post("/{path:.*}", receiver.receive)

    async def worker(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(receiver.work(), name="receiver-worker")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(worker)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Receive and verify fluxora webhooks.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    secret = os.environ.get("WEBHOOK_SECRET", "")
    if not secret:
        print("WEBHOOK_SECRET is required (the same secret as the dispatcher's)", file=sys.stderr)
        return 2
    previous = os.environ.get("WEBHOOK_SECRET_PREVIOUS") or None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    web.run_app(make_app(secret, previous), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
