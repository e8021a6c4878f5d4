"""The Waker hands wake-ups to idle claim loops and keeps nothing for loops that moved on."""

from __future__ import annotations

import asyncio

from fluxora_webhooks.dispatcher import Waker


async def test_timed_out_waits_leave_no_waiter_behind() -> None:
    waker = Waker(cap=4)
    for _ in range(200):
        await waker.wait(0.001)
    assert len(waker._waiters) == 0


async def test_a_wake_up_goes_to_one_idle_loop_and_none_is_lost() -> None:
    waker = Waker(cap=4)
    woken: list[int] = []

    async def loop(i: int) -> None:
        await waker.wait(5)
        woken.append(i)

    tasks = [asyncio.create_task(loop(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    waker.wake()
    await asyncio.sleep(0.01)
    assert len(woken) == 1
    waker.wake_all()
    await asyncio.gather(*tasks)
    assert sorted(woken) == [0, 1, 2]
    # A wake-up while nobody waits is kept for the next loop that would sleep.
    waker2 = Waker(cap=2)
    waker2.wake()
    await asyncio.wait_for(waker2.wait(5), 0.5)
