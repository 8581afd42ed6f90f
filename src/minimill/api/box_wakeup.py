"""Process-local wake-ups for boxes: a host's long poll wakes when this process queues work,
and a tenant's wait wakes when this process accepts a result (a streamed exec's, when it
accepts output too). Other processes notice through
the store within one poll interval: nothing depends on these but latency."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from fastapi import Request

POLL_INTERVAL_S = 0.2  # how often a tenant's wait looks at the store
# How often a host's or runner's held poll looks at the store when nothing in this process woke
# it (each look costs the control plane a query, and idle sites are many).
HOST_RECHECK_S = 1.0


class Wakeup:
    """Wakes current waiters: every one (`notify()`), or the `n` that have waited longest
    (`notify(n)`); later waiters wait for the next notify."""

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def num_waiting(self) -> int:
        """Waiters not woken yet (a woken or timed-out one leaves the line at once)."""
        return len(self._waiters)

    def notify(self, n: int | None = None) -> int:
        """Wake up to `n` waiters (None: all), longest waiting first; how many were woken."""
        woken = 0
        while self._waiters and (n is None or woken < n):
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                woken += 1
        return woken

    async def wait(self, timeout_s: float) -> bool:
        """Until notified (True) or `timeout_s` is up (False)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                # Its place in the line (the oldest waiters time out first: found at once).
                self._waiters.remove(waiter)


class BoxWakeups:
    def __init__(self) -> None:
        self.work = Wakeup()  # a box or an operation is waiting for a host
        self.results = Wakeup()  # a host's result was accepted
        self.output = Wakeup()  # a host's streamed output or result was accepted


async def box_wakeups(request: Request) -> BoxWakeups:
    # async: a lookup, not worth a trip to a thread (deps.py)
    app_state = request.app.state
    if not hasattr(app_state, "box_wakeups"):
        app_state.box_wakeups = BoxWakeups()
    wakeups: BoxWakeups = app_state.box_wakeups
    return wakeups
