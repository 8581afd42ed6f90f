"""The site registry as JSON (GET /v1/sites) and outages a site announces for itself."""

from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import APIRouter

from minimill.api.deps import SiteDep, StoreDep, TenantDep
from minimill.api.errors import error_responses
from minimill.api.schemas import OutageCreate, OutageCreated, SiteList, SiteObject
from minimill.control.sites import add_outage, list_sites
from minimill.protocol import FLEET_PREFIX

router = APIRouter(tags=["sites"], responses=error_responses(400, 401))


@router.get("/v1/sites", response_model=SiteList)
def get_sites(store: StoreDep, _tenant: TenantDep) -> SiteList:
    return SiteList(data=[SiteObject.model_validate(asdict(s))
                          for s in list_sites(store, time.time())])


@router.post(FLEET_PREFIX + "/outages", response_model=OutageCreated)
def announce_outage(body: OutageCreate, store: StoreDep, site: SiteDep) -> OutageCreated:
    """A site announces a planned or forecast outage of its own; placement drains it ahead."""
    add_outage(store, site.name, body.start_at, body.end_at)
    return OutageCreated(site=site.name, start_at=body.start_at, end_at=body.end_at)
