"""The work of the four calls a token site makes in its loop (lease, heartbeat with its
checkpoints, complete, release), whoever parsed them: their FastAPI routes (routes/fleet.py)
or the lean path in front of FastAPI (lean_fleet.py). Each call checks the site token on the
thread of its store work, one trip to the thread pool per call (deps.SiteCall).

Accepted completions and fresh checkpoints wake the realtime waiters of this process at once;
other processes notice through their pollers.
"""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
from starlette.types import Receive

from minimill.api.deps import SiteCall, TokenFleetCall
from minimill.control import batch_finalize, leases, release
from minimill.control.config import ControlConfig
from minimill.control.errors import OverloadedError
from minimill.control.placement import DEFAULT_POLICY
from minimill.control.site_view import PeerView
from minimill.control.store import Store
from minimill.transport.protocol import (
    LEASE_QUEUE_S,
    CompleteRequest,
    CompleteResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    LeaseRequest,
    LeaseResponse,
    ReleaseRequest,
    ReleaseResponse,
)


async def lease(fleet: TokenFleetCall, ask: LeaseRequest, receive: Receive) -> LeaseResponse:
    """Work for the worker; with `wait_s`, held open until there is some or the time is up.
    `receive` is the call's ASGI channel, its body already read: what comes next on it is the
    worker dropping the call."""
    config = fleet.config
    deadline = time.monotonic() + min(ask.wait_s, config.lease_ttl_s / 3)
    gone = threading.Event()
    listener = asyncio.create_task(_until_disconnected(receive, gone))
    try:
        return await _held(fleet, ask, deadline, gone)
    finally:
        listener.cancel()


async def _until_disconnected(receive: Receive, gone: threading.Event) -> None:
    """Set `gone` when the worker drops the call, for the lease transaction to see without a
    trip to the loop."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _held(fleet: TokenFleetCall, ask: LeaseRequest, deadline: float,
                gone: threading.Event) -> LeaseResponse:
    answer = await _look(fleet, ask, gone)
    while True:
        if answer is None:  # the worker dropped the call: nobody reads this
            return LeaseResponse(leases=[], lease_ttl_s=fleet.config.lease_ttl_s)
        left = deadline - time.monotonic()
        if answer.leases or left <= 0:
            return answer
        # Woken when work is queued, a bounded number at a time (lease_wakeup.py): a call
        # that got nothing does not look again on its own.
        if not await fleet.lease_wakeup.wait(left):
            return answer
        # Later looks of this call only look for work (the first touched the site, adopted
        # any held leases and recorded its sessions), with the slots its finished requests
        # freed meanwhile (_lease_now counts them).
        ask = ask.model_copy(update={"adopt_held": False, "held_sessions": None})
        answer = await _look(fleet, ask, gone, relook=True)


async def _look(fleet: TokenFleetCall, ask: LeaseRequest, gone: threading.Event,
                relook: bool = False) -> LeaseResponse | None:
    """One lease transaction, once a lease thread is free; None when the worker dropped the
    call meanwhile (a stopping worker, or one whose call waited past its timeout): what it
    would be granted would wait out its lease. At a thousand sites calls waited for a thread
    and for SQLite's write lock longer than the workers' timeout, and every lease granted to
    them expired unread; the transaction asks again once it holds the lock. A call that gets
    no thread within LEASE_QUEUE_S is refused with a 503 (OverloadedError), so that none
    waits that long."""
    with anyio.move_on_after(LEASE_QUEUE_S) as queued:
        await fleet.lease_threads.acquire()
    if queued.cancelled_caught:
        # No turn within LEASE_QUEUE_S (the line is first come, first served: the calls
        # served meanwhile waited less). Refused, not answered with no work: the call was
        # never looked at, and the worker asks again as it asked (a restarted worker's
        # adoption of its held leases, the name under which a lost answer's leases wait).
        raise OverloadedError(
            f"The control plane is saturated: this lease call waited {LEASE_QUEUE_S:g}s "
            "for its turn and was not looked at; ask again.", retry_after_s=1.0)
    try:
        if gone.is_set():
            return None
        return await anyio.to_thread.run_sync(_lease_now, fleet.store, fleet.site, ask,
                                              fleet.config, fleet.peer_view, gone, relook)
    finally:
        fleet.lease_threads.release()


def _lease_now(store: Store, call: SiteCall, ask: LeaseRequest, config: ControlConfig,
               peers: PeerView, gone: threading.Event, relook: bool) -> LeaseResponse:
    """The lease transaction at the time it starts (not when the call came in: a call may
    wait seconds for a thread, and its leases run from their grant). Each look checks the
    token again: a held call of a site whose token was replaced meanwhile gets no more work."""
    site = call.site(store)
    if relook and ask.slots is not None:
        ask = ask.model_copy(update={
            "capacity": max(0, ask.slots - leases.held_by(store, site.id))})
    return leases.lease(store, site, ask, time.time(), config, DEFAULT_POLICY, peers,
                        gone=gone.is_set)


async def heartbeat(fleet: TokenFleetCall, beat: HeartbeatRequest) -> HeartbeatResponse:
    answer = await anyio.to_thread.run_sync(_heartbeat, fleet.store, fleet.site, beat,
                                            fleet.config)
    fleet.watcher.poke(i.request_id for i in beat.leases
                       if (i.checkpoint is not None or i.delta is not None)
                       and i.request_id in answer.extended)
    return answer


def _heartbeat(store: Store, call: SiteCall, beat: HeartbeatRequest,
               config: ControlConfig) -> HeartbeatResponse:
    return leases.heartbeat(store, call.site(store), beat, time.time(), config)


async def complete(fleet: TokenFleetCall, done: CompleteRequest) -> CompleteResponse:
    answer, batch_ended = await anyio.to_thread.run_sync(_complete, fleet.store, fleet.site,
                                                         done, fleet.config)
    fleet.watcher.poke(answer.accepted)
    if batch_ended:
        fleet.ingest_wake.set()  # a batch's last line: finalize it now
    return answer


def _complete(store: Store, call: SiteCall, done: CompleteRequest,
              config: ControlConfig) -> tuple[CompleteResponse, bool]:
    """The completions accepted, and whether one of them was the last line of its batch (one
    trip to the thread pool for the token's check and both)."""
    site = call.site(store)
    answer = leases.complete(store, site, done, time.time(), config)
    return answer, batch_finalize.any_finishable_among(store, answer.accepted)


async def release_leases(fleet: TokenFleetCall, ask: ReleaseRequest) -> ReleaseResponse:
    answer = await anyio.to_thread.run_sync(_release, fleet.store, fleet.site, ask,
                                            fleet.config)
    fleet.watcher.poke(answer.released)
    if answer.released:
        # Back in the queue: waiting workers take them up.
        fleet.lease_wakeup.notify(len(answer.released))
    return answer


def _release(store: Store, call: SiteCall, ask: ReleaseRequest,
             config: ControlConfig) -> ReleaseResponse:
    return release.release(store, call.site(store), ask, time.time(), config)
