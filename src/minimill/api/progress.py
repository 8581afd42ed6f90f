"""Wake-ups for requests someone is waiting on (a realtime call or a stream).

Progress arrives through the fleet routes of *some* control-plane process. When it is this
process, the route pokes the waiter at once; otherwise one shared poller notices that the row's
`version` changed (a single query for every watched request, every `poll_interval_s`). With
nothing watched the poller sleeps until something is: on a small machine its forty wake-ups a
second would be CPU taken from the engine beside it.

A waiter reads its row when woken, not on a timer: between wake-ups it only looks whether its
client left, which costs no trip to the store. At a thousand sites, when a realtime request
waited seconds for a lease, every waiter re-reading its row twice a second took more of the
control plane's CPU than its lease calls (docs/concepts/control-plane-scale.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import anyio

from minimill.control.requests import versions
from minimill.control.store import Store

log = logging.getLogger("minimill.api")

# How often a waiter looks whether its client left (no store read).
CLIENT_CHECK_S = 0.5
# Longest a waiter goes without reading its row when nothing woke it: a backstop for a wake-up
# lost to a failed poll, not the way progress is noticed.
REREAD_S = 5.0


class Watch:
    """One waiter's wake-up: set when its request's row may have changed."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.version = -1  # last version the poller saw
        self.event = asyncio.Event()

    async def wait(self, timeout_s: float) -> bool:
        """Return on the next wake-up (True), or after `timeout_s` (False)."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout_s)
            woken = True
        except TimeoutError:
            woken = False
        self.event.clear()
        return woken

    async def changed(self, gone: Callable[[], Awaitable[bool]],
                      reread_s: float = REREAD_S) -> bool:
        """Wait until the row may have changed (woken, or `reread_s` without a wake-up):
        True, read it now. False as soon as `gone` says the client left, looked at every
        `CLIENT_CHECK_S`."""
        deadline = time.monotonic() + reread_s
        while True:
            woken = await self.wait(min(CLIENT_CHECK_S, max(deadline - time.monotonic(), 0.0)))
            if await gone():
                return False
            if woken or time.monotonic() >= deadline:
                return True


class ProgressWatcher:
    def __init__(self, store: Store, poll_interval_s: float) -> None:
        self.store = store
        self.poll_interval_s = poll_interval_s
        self._watches: dict[str, Watch] = {}
        # Set while anything is watched; made by `run`, on the event loop it waits on.
        self._watched: asyncio.Event | None = None

    def watch(self, request_id: str) -> Watch:
        """Call from the event loop the poller runs on."""
        watch = self._watches[request_id] = Watch(request_id)
        if self._watched is not None:
            self._watched.set()
        return watch

    def unwatch(self, watch: Watch) -> None:
        if self._watches.get(watch.request_id) is watch:
            del self._watches[watch.request_id]

    def poke(self, request_ids: Iterable[str]) -> None:
        """Progress arrived in this process (call from the event loop)."""
        for request_id in request_ids:
            watch = self._watches.get(request_id)
            if watch is not None:
                watch.event.set()

    async def run(self) -> None:
        """Poll the store for progress made through other processes, forever."""
        self._watched = watched = asyncio.Event()
        while True:
            if not self._watches:
                watched.clear()
                await watched.wait()
            if self._watches:
                try:
                    seen = await anyio.to_thread.run_sync(versions, self.store,
                                                          list(self._watches))
                except Exception:  # a store hiccup must not end the poller
                    log.exception("progress poll failed")
                    seen = {}
                for request_id, version in seen.items():
                    watch = self._watches.get(request_id)
                    if watch is not None and watch.version != version:
                        watch.version = version
                        watch.event.set()
            await asyncio.sleep(self.poll_interval_s)
