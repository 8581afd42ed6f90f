"""The operators' dashboard: `/dashboard` (one HTML page that updates itself) and
`/dashboard/data` (the JSON it polls). Operator keys only, sent as a bearer token or, from a
browser, as the cookie that `/dashboard?key=mmo-...` sets (then the key leaves the address
bar). Anyone else gets what an unknown URL gets."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from minimill.api.deps import ConfigDep, Credentials, StoreDep
from minimill.api.errors import unknown_url
from minimill.control.batches import recent_batches
from minimill.control.box_hosts import slot_use
from minimill.control.fleet_stats import fleet_stats
from minimill.control.keys import authenticate_operator
from minimill.control.leases import policy_for
from minimill.control.records import ACTIVE_REQUEST_STATUSES, Operator, Tier
from minimill.control.site_view import list_sites

COOKIE = "minimill_operator"
_PAGE = (Path(__file__).parent / "dashboard.html").read_text()

router = APIRouter(tags=["operator"], include_in_schema=False)


def get_dashboard_operator(request: Request, store: StoreDep,
                           credentials: Credentials) -> Operator:
    key = credentials.credentials if credentials is not None else request.cookies.get(COOKIE)
    operator = authenticate_operator(store, key) if key else None
    if operator is None:
        raise unknown_url()
    return operator


DashboardOperatorDep = Annotated[Operator, Depends(get_dashboard_operator)]


@router.get("/dashboard", response_class=HTMLResponse)
def dashboard(request: Request, store: StoreDep, credentials: Credentials,
              key: str | None = None) -> Response:
    if key is not None:  # a browser's first visit: keep the key in a cookie, not the URL
        if authenticate_operator(store, key) is None:
            raise unknown_url()
        response = RedirectResponse("/dashboard", status_code=303)
        response.set_cookie(COOKIE, key, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response
    get_dashboard_operator(request, store, credentials)
    return HTMLResponse(_PAGE)


@router.get("/dashboard/data")
def dashboard_data(store: StoreDep, config: ConfigDep,
                   _operator: DashboardOperatorDep) -> dict[str, Any]:
    now = time.time()
    sites = list_sites(store, now, policy_for(config))
    stats = fleet_stats(store)
    slots = slot_use(store)
    queue = {tier.value: {status.value: stats.queue.get((tier.value, status.value), 0)
                          for status in ACTIVE_REQUEST_STATUSES} for tier in Tier}
    return {
        "now": now,
        "sites": [{"name": s.name, "status": s.status, "chip": s.chip,
                   "price_now": s.price_now, "uptime": s.uptime,
                   "measured_tokens_per_s": s.measured_tokens_per_s,
                   "cost_usd_per_mtok": s.cost_usd_per_mtok, "in_flight": s.in_flight,
                   "usage_rejections": s.usage_rejections,
                   "outages_ahead": [o for o in s.outages if o["end_at"] > now]}
                  for s in sites],
        "queue": queue,
        # Which boxes hold host slots, by host; how many boxes wait for one.
        "boxes": {"held": slots.held, "pending": slots.pending},
        "batches": [{"id": b.id, "status": b.status.value, "total": b.counts.total,
                     "completed": b.counts.completed, "failed": b.counts.failed}
                    for b in recent_batches(store)],
        "totals": {"tokens": sum(s.tokens_generated for s in stats.sites),
                   "cost_usd": sum(s.cost_usd for s in stats.sites),
                   "billed_usd": sum(s.billed_usd for s in stats.sites)},
    }
