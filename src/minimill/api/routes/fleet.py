"""The worker protocol's server side (protocol.py): lease, heartbeat, complete, release, and the
outages a site announces, lists and withdraws for itself.

Authenticated with a site token: lease, heartbeat, complete and release need a site registered
for tokens (`--serves tokens`) and check the token on the thread of their store work, one trip
to the thread pool per call (deps.SiteCall); a site's own outages answer any of its tokens.
Accepted completions and fresh checkpoints wake the realtime waiters of this process at once;
other processes notice through their pollers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict

import anyio
from fastapi import APIRouter, Request

from minimill.api.box_wakeup import Wakeup
from minimill.api.deps import (
    SiteCall,
    SiteDep,
    StoreDep,
    TokenFleetDep,
)
from minimill.api.errors import error_responses
from minimill.api.schemas import (
    OutageCreate,
    OutageCreated,
    OutageDeleted,
    OutageList,
    OutageObject,
)
from minimill.control import batch_finalize, leases, release
from minimill.control.config import ControlConfig
from minimill.control.placement import DEFAULT_POLICY
from minimill.control.site_view import PeerView
from minimill.control.sites import add_outage, list_outages, remove_outage
from minimill.control.store import Store
from minimill.transport.protocol import (
    FLEET_PREFIX,
    CompleteRequest,
    CompleteResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    LeaseRequest,
    LeaseResponse,
    ReleaseRequest,
    ReleaseResponse,
)

# Lease transactions running at once in one process. On SQLite they queue for its one write
# lock anyway; unbounded, a thousand sites' lease calls held every thread of the pool waiting
# for it, and the heartbeats and completions that free their slots found none.
LEASE_THREADS = 8

router = APIRouter(prefix=FLEET_PREFIX, tags=["fleet"], responses=error_responses(400, 401, 403))


@router.post("/lease", response_model=LeaseResponse)
async def lease(ask: LeaseRequest, request: Request, fleet: TokenFleetDep) -> LeaseResponse:
    """Work for the worker; with `wait_s`, held open until there is some or the time is up."""
    store, call, config, wakeup = fleet.store, fleet.site, fleet.config, fleet.lease_wakeup
    deadline = time.monotonic() + min(ask.wait_s, config.lease_ttl_s / 3)
    nothing = LeaseResponse(leases=[], lease_ttl_s=config.lease_ttl_s)
    gone = threading.Event()
    listener = asyncio.create_task(_until_disconnected(request, gone))
    try:
        return await _held(request, store, call, ask, config, wakeup, deadline, nothing, gone)
    finally:
        listener.cancel()


async def _until_disconnected(request: Request, gone: threading.Event) -> None:
    """Set `gone` when the worker drops the call (its body is read: what comes next on the
    connection is its end), for the lease transaction to see without a trip to the loop."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _held(request: Request, store: Store, call: SiteCall, ask: LeaseRequest,
                config: ControlConfig, wakeup: Wakeup, deadline: float,
                nothing: LeaseResponse, gone: threading.Event) -> LeaseResponse:
    answer = await _look(request, store, call, ask, config, gone)
    while True:
        if answer is None:
            return nothing  # the worker dropped the call: nobody reads this
        left = deadline - time.monotonic()
        if answer.leases or left <= 0:
            return answer
        # Woken when work is queued, a bounded number at a time (lease_wakeup.py): a call
        # that got nothing does not look again on its own.
        if not await wakeup.wait(left):
            return answer
        # Later looks of this call only look for work (the first touched the site, adopted
        # any held leases and recorded its sessions), with the slots its finished requests
        # freed meanwhile (_lease_now counts them).
        ask = ask.model_copy(update={"adopt_held": False, "held_sessions": None})
        answer = await _look(request, store, call, ask, config, gone, relook=True)


async def _look(request: Request, store: Store, call: SiteCall, ask: LeaseRequest,
                config: ControlConfig, gone: threading.Event,
                relook: bool = False) -> LeaseResponse | None:
    """One lease transaction, once a lease thread is free; None when the worker dropped the
    call meanwhile (a stopping worker, or one whose call waited past its timeout): what it
    would be granted would wait out its lease. At a thousand sites calls waited for a thread
    and for SQLite's write lock longer than the workers' timeout, and every lease granted to
    them expired unread; the transaction asks again once it holds the lock."""
    async with _lease_threads(request):
        if gone.is_set():
            return None
        return await anyio.to_thread.run_sync(_lease_now, store, call, ask, config,
                                              request.app.state.peer_view, gone, relook)


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


def _lease_threads(request: Request) -> anyio.CapacityLimiter:
    """This app's limiter of lease threads (made on first use, in the loop that serves it)."""
    limiter: anyio.CapacityLimiter | None = getattr(request.app.state, "lease_threads", None)
    if limiter is None:
        limiter = request.app.state.lease_threads = anyio.CapacityLimiter(LEASE_THREADS)
    return limiter


@router.post("/heartbeat", response_model=HeartbeatResponse)
async def heartbeat(beat: HeartbeatRequest, fleet: TokenFleetDep) -> HeartbeatResponse:
    answer = await anyio.to_thread.run_sync(_heartbeat, fleet.store, fleet.site, beat,
                                            fleet.config)
    fleet.watcher.poke(i.request_id for i in beat.leases
                 if (i.checkpoint is not None or i.delta is not None)
                 and i.request_id in answer.extended)
    return answer


def _heartbeat(store: Store, call: SiteCall, beat: HeartbeatRequest,
               config: ControlConfig) -> HeartbeatResponse:
    return leases.heartbeat(store, call.site(store), beat, time.time(), config)


# A rejection carries a message only when there is more to say than its reason.
@router.post("/complete", response_model=CompleteResponse, response_model_exclude_none=True)
async def complete(done: CompleteRequest, request: Request,
                   fleet: TokenFleetDep) -> CompleteResponse:
    answer, batch_ended = await anyio.to_thread.run_sync(_complete, fleet.store, fleet.site,
                                                         done, fleet.config)
    fleet.watcher.poke(answer.accepted)
    if batch_ended:
        request.app.state.ingest_wake.set()  # a batch's last line: finalize it now
    return answer


def _complete(store: Store, call: SiteCall, done: CompleteRequest,
              config: ControlConfig) -> tuple[CompleteResponse, bool]:
    """The completions accepted, and whether one of them was the last line of its batch (one
    trip to the thread pool for the token's check and both)."""
    site = call.site(store)
    answer = leases.complete(store, site, done, time.time(), config)
    return answer, batch_finalize.any_finishable_among(store, answer.accepted)


@router.post("/release", response_model=ReleaseResponse)
async def release_leases(ask: ReleaseRequest, fleet: TokenFleetDep) -> ReleaseResponse:
    answer = await anyio.to_thread.run_sync(_release, fleet.store, fleet.site, ask, fleet.config)
    fleet.watcher.poke(answer.released)
    if answer.released:
        # Back in the queue: waiting workers take them up.
        fleet.lease_wakeup.notify(len(answer.released))
    return answer


def _release(store: Store, call: SiteCall, ask: ReleaseRequest,
             config: ControlConfig) -> ReleaseResponse:
    return release.release(store, call.site(store), ask, time.time(), config)


@router.post("/outages", response_model=OutageCreated)
def announce_outage(body: OutageCreate, store: StoreDep, site: SiteDep) -> OutageCreated:
    """A site announces a planned or forecast outage of its own; placement drains it ahead."""
    outage_id = add_outage(store, site.name, body.start_at, body.end_at)
    return OutageCreated(id=outage_id, site=site.name, start_at=body.start_at,
                         end_at=body.end_at)


@router.get("/outages", response_model=OutageList)
def get_outages(store: StoreDep, site: SiteDep, include_past: bool = False) -> OutageList:
    """The site's announced outages not over yet (all of them with `include_past`)."""
    records = list_outages(store, time.time(), site.name, include_past=include_past)
    return OutageList(data=[OutageObject.model_validate(asdict(r)) for r in records])


@router.delete("/outages/{outage_id}", response_model=OutageDeleted,
               responses=error_responses(404))
def delete_outage(outage_id: int, store: StoreDep, site: SiteDep) -> OutageDeleted:
    """Withdraw one of the site's outages; placement counts on the site again at once."""
    record = remove_outage(store, outage_id, site.name)
    return OutageDeleted(id=record.id)
