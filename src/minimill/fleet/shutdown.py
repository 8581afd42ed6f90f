"""A worker's way out: finish what it can, hand back the rest with its checkpoints, deliver.

Running requests get `drain_timeout_s` to finish (none at all after a second stop). Whatever
is still running is stopped, checkpointed and released, so it resumes on another site at once
instead of after its lease expires. The releases, then the finished results, get FINAL_SEND_S
each to reach the control plane: an unreachable control plane delays the exit by that much at
most, and the leases not handed back then simply expire (their last checkpoints are stored).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from minimill.fleet.held import HeldLease
from minimill.fleet.releases import Releases
from minimill.transport.client import FINAL_SEND_S, send_within
from minimill.transport.protocol import CompletionItem

log = logging.getLogger("minimill.worker")


class Leaving(Protocol):
    """What the way out needs of the worker (fleet/loops.py's Worker, which calls `drain`)."""

    drain_timeout_s: float
    hurry: asyncio.Event  # a second stop(): no waiting for running requests
    held: dict[str, HeldLease]
    outbox: dict[str, CompletionItem]  # finished results not yet delivered
    releases: Releases

    def hand_back(self, request_ids: list[str]) -> int: ...

    async def wait(self, event: asyncio.Event, timeout: float) -> None: ...


async def drain(worker: Leaving) -> None:
    deadline = time.monotonic() + worker.drain_timeout_s
    while (time.monotonic() < deadline and not worker.hurry.is_set()
           and any(h.result is None for h in worker.held.values())):
        await worker.wait(worker.hurry, 0.1)
    unfinished = [h.request_id for h in worker.held.values() if h.result is None]
    if unfinished:
        log.info("checkpointing %d unfinished requests before exit and handing them back",
                 len(unfinished))
        worker.hand_back(unfinished)
    await send_within(worker.releases.send, "final checkpoints")
    if worker.releases.pending:
        log.warning("%d final checkpoints not delivered; those leases will expire",
                    len(worker.releases.pending))
    flush_deadline = time.monotonic() + FINAL_SEND_S
    while worker.outbox and time.monotonic() < flush_deadline:
        await asyncio.sleep(0.05)
