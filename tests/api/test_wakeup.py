"""Wakeup: notify(n) wakes the n waiters that have waited longest, notify() every one."""

from __future__ import annotations

import asyncio

from minimill.api.box_wakeup import Wakeup


async def _woken_in_order() -> tuple[list[int], list[int], int]:
    wakeup = Wakeup()
    woken: list[int] = []

    async def wait(i: int) -> None:
        if await wakeup.wait(3600.0):
            woken.append(i)

    tasks = []
    for i in range(10):
        tasks.append(asyncio.create_task(wait(i)))
        while wakeup.num_waiting <= i:  # each in line before the next
            await asyncio.sleep(0)
    assert wakeup.notify(3) == 3
    await asyncio.wait(tasks[:3])
    first = list(woken)
    still = wakeup.num_waiting
    assert wakeup.notify() == 7
    await asyncio.wait(tasks)
    return first, woken, still


def test_notify_n_wakes_the_longest_waiting_n_and_notify_wakes_the_rest() -> None:
    first, woken, still = asyncio.run(_woken_in_order())
    assert first == [0, 1, 2]
    assert still == 7  # the others were not woken
    assert sorted(woken) == list(range(10))


async def _timed_out() -> tuple[bool, int, int]:
    wakeup = Wakeup()
    woke = await wakeup.wait(0.0)
    return woke, wakeup.num_waiting, wakeup.notify(5)


def test_a_wait_that_times_out_leaves_the_line() -> None:
    woke, waiting, woken = asyncio.run(_timed_out())
    assert not woke and waiting == 0 and woken == 0
