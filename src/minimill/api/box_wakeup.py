"""Process-local wake-ups for boxes: a host's long poll wakes when this process queues work,
and a tenant's wait wakes when this process accepts a result (a streamed exec's, when it
accepts output too). Other processes notice through
the store within one poll interval: nothing depends on these but latency."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request

POLL_INTERVAL_S = 0.2  # how often a tenant's wait looks at the store
# How often a host's or runner's held poll looks at the store when nothing in this process woke
# it (each look costs the control plane a query, and idle sites are many).
HOST_RECHECK_S = 1.0


class Wakeup:
    """Wakes every current waiter at once; later waiters wait for the next notify."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout_s)


class BoxWakeups:
    def __init__(self) -> None:
        self.work = Wakeup()  # a box or an operation is waiting for a host
        self.results = Wakeup()  # a host's result was accepted
        self.output = Wakeup()  # a host's streamed output or result was accepted


def box_wakeups(request: Request) -> BoxWakeups:
    app_state = request.app.state
    if not hasattr(app_state, "box_wakeups"):
        app_state.box_wakeups = BoxWakeups()
    wakeups: BoxWakeups = app_state.box_wakeups
    return wakeups
