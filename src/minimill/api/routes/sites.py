"""Operator routes of the site registry: every site with its health, cost and margin, and the
outages operators announce for a site. Other callers are answered as for an unknown URL."""

from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import APIRouter

from minimill.api.deps import ConfigDep, OperatorDep, StoreDep
from minimill.api.errors import error_responses
from minimill.api.operator_schemas import SiteList, SiteObject
from minimill.api.schemas import (
    OutageCreate,
    OutageCreated,
    OutageDeleted,
    OutageList,
    OutageObject,
)
from minimill.control.leases import policy_for
from minimill.control.site_view import list_sites
from minimill.control.sites import add_outage, list_outages, remove_outage

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
