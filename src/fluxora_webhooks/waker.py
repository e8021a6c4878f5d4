"""Wake-ups for the claim loops."""

from __future__ import annotations

import asyncio
import collections
import contextlib


class Waker:
    """Hands each wake-up (a NOTIFY, or a full batch) to one idle claim loop.

    Wake-ups that arrive while no loop is idle are kept (up to ``cap``) so none is lost.
    """

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._pending = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._pending = min(self._pending + 1, self._cap)

    def wake_all(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        self._pending = self._cap

    async def wait(self, timeout: float) -> None:
        if self._pending:
            self._pending -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            if not waiter.done():
                waiter.cancel()
            # A waiter that timed out leaves the queue now, not at the next wake-up: an
            # idle dispatcher would otherwise pile up one per poll.
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
