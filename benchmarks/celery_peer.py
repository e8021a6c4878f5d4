"""The second peer: a Celery worker doing our job (take a task, POST its payload, ack).

Celery is the job queue Python backend teams reach for first when they "just use a queue"
for webhooks (a task per delivery, retries with ``autoretry_for``); arq is smaller and
asyncio-native but far less used. The broker is Redis (the one this machine runs), and the
worker POSTs with a ``requests`` session kept per worker process (keep-alive), the same body
and header count as the raw client and the pgqueuer peer.

Run by ``run.py``: the tasks are sent first (``--send N``), then workers started with
``celery -A celery_peer worker``; the receiver's first and last receipt give the rate.

Environment: ``BENCH_CELERY_BROKER`` (a Redis URL with a database of its own),
``BENCH_CELERY_URL`` (where to POST), ``BENCH_CELERY_QUEUE`` (a queue of this run's own,
deleted at the end), ``BENCH_CELERY_ACKS_LATE`` (``1``: acknowledge after
the POST, which is what a durable webhook sender needs; ``0``: Celery's default, before).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import body_bytes, raw_headers
from celery import Celery

BROKER = os.environ.get("BENCH_CELERY_BROKER", "redis://127.0.0.1:6379/15")
TARGET = os.environ.get("BENCH_CELERY_URL", "http://127.0.0.1:8080/celery")
QUEUE = os.environ.get("BENCH_CELERY_QUEUE", "bench-celery")
ACKS_LATE = os.environ.get("BENCH_CELERY_ACKS_LATE", "1") == "1"

app = Celery("celery_peer", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_acks_late=ACKS_LATE,
    task_ignore_result=True,
    worker_prefetch_multiplier=int(os.environ.get("BENCH_CELERY_PREFETCH", "4")),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_serializer="json",
    accept_content=["json"],
)

_session: Any = None


@app.task(name="webhook", autoretry_for=(OSError,), retry_backoff=True, max_retries=5)
def webhook(payload: str) -> None:
    global _session
    if _session is None:
        import requests

        _session = requests.Session()
    data = payload.encode()
    response = _session.post(TARGET, data=data, headers=raw_headers(data))
    if response.status_code >= 300:
        raise OSError(f"HTTP {response.status_code}")


def send(n: int) -> float:
    """Send N tasks; the seconds it took."""
    payload = body_bytes().decode()
    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for _ in range(n):
            webhook.apply_async((payload,), producer=producer)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--send", type=int, required=True, help="tasks to send")
    args = parser.parse_args()
    seconds = send(args.send)
    print(f"SENT {args.send} {seconds:.3f}", flush=True)


if __name__ == "__main__":
    main()
