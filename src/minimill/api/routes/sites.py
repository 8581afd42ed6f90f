"""Operator routes of the site registry: every site with its health, cost and margin, and the
outages operators announce for a site. Other callers are answered as for an unknown URL."""

from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import APIRouter

from minimill.api.deps import ConfigDep, OperatorDep, StoreDep
from minimill.api.errors import error_responses
from minimill.api.operator_schemas import (
    PriceScheduleObject,
    PriceScheduleSet,
    SiteList,
    SiteObject,
)
from minimill.api.schemas import (
    OutageCreate,
    OutageCreated,
    OutageDeleted,
    OutageList,
    OutageObject,
)
from minimill.control.errors import InvalidRequestError
from minimill.control.leases import policy_for
from minimill.control.price_schedule import parse, utc_day_start
from minimill.control.site_view import list_sites
from minimill.control.sites import add_outage, list_outages, remove_outage, set_price_schedule

# Not in the public OpenAPI document: tenants should not learn these routes exist.
router = APIRouter(prefix="/v1/sites", tags=["operator"], include_in_schema=False,
                   responses=error_responses(400, 404))


@router.get("", response_model=SiteList)
def get_sites(store: StoreDep, config: ConfigDep, _operator: OperatorDep) -> SiteList:
    statuses = list_sites(store, time.time(), policy_for(config))
    return SiteList(data=[SiteObject.model_validate(asdict(s)) for s in statuses])


@router.post("/{site}/outages", response_model=OutageCreated)
def add_site_outage(site: str, body: OutageCreate, store: StoreDep,
                    _operator: OperatorDep) -> OutageCreated:
    """Announce a planned or forecast outage of a site; placement drains it ahead."""
    outage_id = add_outage(store, site, body.start_at, body.end_at)
    return OutageCreated(id=outage_id, site=site, start_at=body.start_at, end_at=body.end_at)


@router.get("/{site}/outages", response_model=OutageList)
def get_site_outages(site: str, store: StoreDep, _operator: OperatorDep,
                     include_past: bool = False) -> OutageList:
    """A site's announced outages not over yet (all of them with `include_past`)."""
    records = list_outages(store, time.time(), site, include_past=include_past)
    return OutageList(data=[OutageObject.model_validate(asdict(r)) for r in records])


@router.delete("/{site}/outages/{outage_id}", response_model=OutageDeleted)
def delete_site_outage(site: str, outage_id: int, store: StoreDep,
                       _operator: OperatorDep) -> OutageDeleted:
    """Withdraw one of a site's outages; placement counts on the site again at once."""
    record = remove_outage(store, outage_id, site)
    return OutageDeleted(id=record.id)


@router.put("/{site}/price_schedule", response_model=PriceScheduleObject)
def put_price_schedule(site: str, body: PriceScheduleSet, store: StoreDep,
                       _operator: OperatorDep) -> PriceScheduleObject:
    """Make a site's price follow an hourly schedule: placement ranks it at its price now and
    places background work with a deadline into its cheapest hours that still meet it."""
    try:
        schedule = parse(body.model_dump(exclude_none=True), utc_day_start(time.time()))
    except ValueError as e:
        raise InvalidRequestError(str(e), param="hourly_usd") from e
    set_price_schedule(store, site, schedule)
    return PriceScheduleObject(site=site, start_at=schedule.start_at,
                               hourly_usd=list(schedule.hourly_usd), repeat=schedule.repeat)


@router.delete("/{site}/price_schedule", response_model=PriceScheduleObject)
def delete_price_schedule(site: str, store: StoreDep,
                          _operator: OperatorDep) -> PriceScheduleObject:
    """Back to the site's flat price_per_hour."""
    set_price_schedule(store, site, None)
    return PriceScheduleObject(site=site, start_at=None, hourly_usd=[], repeat=False)
