"""The worker protocol's server side (protocol.py): lease, heartbeat, complete.

Authenticated with a site token. Accepted completions and fresh checkpoints wake the realtime
waiters of this process at once; other processes notice through their pollers.
"""

from __future__ import annotations

import time

import anyio
from fastapi import APIRouter

from minimill.api.deps import ConfigDep, SiteDep, StoreDep, WatcherDep
from minimill.api.errors import error_responses
from minimill.control import leases
from minimill.protocol import (
    FLEET_PREFIX,
    CompleteRequest,
    CompleteResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    LeaseRequest,
    LeaseResponse,
)

router = APIRouter(prefix=FLEET_PREFIX, tags=["fleet"], responses=error_responses(400, 401))


@router.post("/lease", response_model=LeaseResponse)
async def lease(ask: LeaseRequest, store: StoreDep, site: SiteDep,
                config: ConfigDep) -> LeaseResponse:
    return await anyio.to_thread.run_sync(leases.lease, store, site, ask, time.time(), config)


@router.post("/heartbeat", response_model=HeartbeatResponse)
async def heartbeat(beat: HeartbeatRequest, store: StoreDep, site: SiteDep, config: ConfigDep,
                    watcher: WatcherDep) -> HeartbeatResponse:
    answer = await anyio.to_thread.run_sync(leases.heartbeat, store, site, beat, time.time(),
                                            config)
    watcher.poke(i.request_id for i in beat.leases
                 if (i.checkpoint is not None or i.delta is not None)
                 and i.request_id in answer.extended)
    return answer


@router.post("/complete", response_model=CompleteResponse)
async def complete(done: CompleteRequest, store: StoreDep, site: SiteDep, config: ConfigDep,
                   watcher: WatcherDep) -> CompleteResponse:
    answer = await anyio.to_thread.run_sync(leases.complete, store, site, done, time.time(),
                                            config)
    watcher.poke(answer.accepted)
    return answer
