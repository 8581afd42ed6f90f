"""The worker protocol's server side (protocol.py): lease, heartbeat, complete, release, and the
outages a site announces, lists and withdraws for itself.

Authenticated with a site token: lease, heartbeat, complete and release need a site registered
for tokens (`--serves tokens`); their work (token_calls.py) checks the token on the thread of
its store work. The lean path (lean_fleet.py) answers well-formed calls of those four before
FastAPI sees them, with the same work; these routes answer the rest (and every call when the
lean path is off), and define what the API's schema says of them. A site's own outages answer
any of its tokens.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import APIRouter, Request

from minimill.api import token_calls
from minimill.api.deps import SiteDep, StoreDep, TokenFleetDep
from minimill.api.errors import error_responses
from minimill.api.schemas import (
    OutageCreate,
    OutageCreated,
    OutageDeleted,
    OutageList,
    OutageObject,
)
from minimill.control.sites import add_outage, list_outages, remove_outage
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

router = APIRouter(prefix=FLEET_PREFIX, tags=["fleet"], responses=error_responses(400, 401, 403))


@router.post("/lease", response_model=LeaseResponse, responses=error_responses(503))
async def lease(ask: LeaseRequest, request: Request, fleet: TokenFleetDep) -> LeaseResponse:
    """Work for the worker; with `wait_s`, held open until there is some or the time is up.
    A 503 (with Retry-After) when the call got no turn in time: ask again as asked."""
    return await token_calls.lease(fleet, ask, request.receive)


@router.post("/heartbeat", response_model=HeartbeatResponse)
async def heartbeat(beat: HeartbeatRequest, fleet: TokenFleetDep) -> HeartbeatResponse:
    return await token_calls.heartbeat(fleet, beat)


# A rejection carries a message only when there is more to say than its reason.
@router.post("/complete", response_model=CompleteResponse, response_model_exclude_none=True)
async def complete(done: CompleteRequest, fleet: TokenFleetDep) -> CompleteResponse:
    return await token_calls.complete(fleet, done)


@router.post("/release", response_model=ReleaseResponse)
async def release_leases(ask: ReleaseRequest, fleet: TokenFleetDep) -> ReleaseResponse:
    return await token_calls.release_leases(fleet, ask)


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
