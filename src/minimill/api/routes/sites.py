"""The site registry as JSON (GET /v1/sites) and the outages of a site: announced, listed and
withdrawn (/v1/fleet/outages)."""

from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import APIRouter
from pydantic import Field

from minimill.api.deps import ConfigDep, SiteDep, StoreDep, TenantDep
from minimill.api.errors import error_responses
from minimill.api.schemas import (
    OutageCreate,
    OutageCreated,
    OutageDeleted,
    OutageList,
    OutageObject,
    SiteObject,
)
from minimill.api.schemas import SiteList as _SiteList
from minimill.control.leases import policy_for
from minimill.control.sites import add_outage, list_outages, list_sites, remove_outage
from minimill.protocol import FLEET_PREFIX

router = APIRouter(tags=["sites"], responses=error_responses(400, 401))


class SiteHealthObject(SiteObject):
    """A site with the health figures placement ranks it by (site_health.py defines them)."""

    status: str = Field(description="new | online | draining | outage | offline")
    expected_loss: float = Field(description="Fraction of placed work expected to be lost.")
    effective_usd_per_mtok: float = Field(
        description="usd_per_mtok / (1 - expected_loss): background work goes to the lowest.")
    free_capacity: int = Field(description="What its worker last said it could still take.")


class SiteHealthList(_SiteList):
    data: list[SiteHealthObject]  # type: ignore[assignment]


@router.get("/v1/sites", response_model=SiteHealthList)
def get_sites(store: StoreDep, config: ConfigDep, _tenant: TenantDep) -> SiteHealthList:
    statuses = list_sites(store, time.time(), policy_for(config))
    return SiteHealthList(data=[SiteHealthObject.model_validate(asdict(s)) for s in statuses])


@router.post(FLEET_PREFIX + "/outages", response_model=OutageCreated)
def announce_outage(body: OutageCreate, store: StoreDep, site: SiteDep) -> OutageCreated:
    """A site announces a planned or forecast outage of its own; placement drains it ahead."""
    outage_id = add_outage(store, site.name, body.start_at, body.end_at)
    return OutageCreated(id=outage_id, site=site.name, start_at=body.start_at,
                         end_at=body.end_at)


@router.get(FLEET_PREFIX + "/outages", response_model=OutageList)
def get_outages(store: StoreDep, site: SiteDep, include_past: bool = False) -> OutageList:
    """The site's announced outages not over yet (all of them with `include_past`)."""
    records = list_outages(store, time.time(), site.name, include_past=include_past)
    return OutageList(data=[OutageObject.model_validate(asdict(r)) for r in records])


@router.delete(FLEET_PREFIX + "/outages/{outage_id}", response_model=OutageDeleted,
               responses=error_responses(404))
def delete_outage(outage_id: int, store: StoreDep, site: SiteDep) -> OutageDeleted:
    """Withdraw one of the site's outages; placement counts on the site again at once."""
    record = remove_outage(store, outage_id, site.name)
    return OutageDeleted(id=record.id)
