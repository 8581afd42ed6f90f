"""A process-local wake-up for workers' held lease calls.

A held call that got nothing waits to be woken; it does not look at the store again on its own.
Two things wake it:

- this process queueing work (a realtime call, a validated batch, leases given back or
  reaped) wakes as many held calls as it queued requests, those that have waited longest
  first: one realtime request wakes one call, not every call of the process (at a thousand
  sites, waking all made a thousand placements for one request);
- while work stays queued (queued by another process, or left by the calls that looked), the
  process wakes `RELOOKS` more held calls every `RECHECK_S`, in turn, after one read of the
  queue for all of them: calls that got nothing do not each look every second.

Nothing depends on this but latency: a worker's next lease call looks at once.
"""

from __future__ import annotations

import asyncio
import logging

import anyio
from fastapi import FastAPI

from minimill.api.box_wakeup import Wakeup
from minimill.control import leases
from minimill.control.store import Store

# How often the process looks whether work stays queued for its held calls.
RECHECK_S = 1.0
# Held calls woken per look while work stays queued: enough to take up work that another
# process queued or that this one's calls left within a second or two, few enough that a
# thousand idle sites' calls do not make a thousand placements a second.
RELOOKS = 16

log = logging.getLogger("minimill.api")


def lease_wakeup_of(app: FastAPI) -> Wakeup:
    state = app.state
    if not hasattr(state, "lease_wakeup"):
        state.lease_wakeup = Wakeup()
    wakeup: Wakeup = state.lease_wakeup
    return wakeup


async def relook(store: Store, wakeup: Wakeup, interval_s: float = RECHECK_S,
                 relooks: int = RELOOKS) -> None:
    """While work is queued, wake `relooks` held lease calls every `interval_s` (a task of
    the app's lifespan)."""
    while True:
        try:
            if wakeup.num_waiting and await anyio.to_thread.run_sync(leases.work_queued, store):
                wakeup.notify(relooks)
        except Exception:  # the store may be briefly unreachable; look again next time
            log.exception("looking for queued work failed")
        await asyncio.sleep(interval_s)
