"""stop() is prompt during a database outage: it interrupts a claim loop waiting for a pool
connection or sleeping in its back-off, instead of letting them run out."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from fluxora_webhooks.dispatcher import Dispatcher
from tests.support.dispatch import make_settings

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_stop_interrupts_the_wait_for_an_unreachable_database() -> None:
    conninfo = f"postgresql://postgres@127.0.0.1:{_closed_port()}/none?connect_timeout=2"
    dispatcher = Dispatcher(make_settings("http://127.0.0.1:9/hook"), conninfo=conninfo)
    task = asyncio.create_task(dispatcher.run())
    await dispatcher.ready.wait()
    await asyncio.sleep(1.0)  # the loops now wait for a connection, or back off after one
    started = time.monotonic()
    dispatcher.stop()
    await asyncio.wait_for(task, 30)
    # The pool's own wait is 5 s and a back-off up to 10 s: a stop must not sit them out.
    assert time.monotonic() - started < 2.0
