"""What operators' monitoring scrapes from the store: queue depth by tier and status, and each
site's counters (tokens, completions, lease expiries, stale completions, completions refused
for a usage report that disagrees, waste, cost, billed).
Read in one transaction; every control-plane process answers the same."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select

from minimill.control.records import ACTIVE_REQUEST_STATUSES
from minimill.control.store import Store
from minimill.control.tables import requests, sites


@dataclass(frozen=True, slots=True)
class SiteCounters:
    name: str
    chip: str
    tokens_generated: int
    completions: int
    leases_granted: int
    leases_expired: int
    stale_completions: int
    usage_rejections: int
    wasted_tokens: int
    cost_usd: float
    billed_usd: float


@dataclass(frozen=True, slots=True)
class FleetStats:
    queue: dict[tuple[str, str], int]  # (tier, status) -> requests, for queued and leased
    sites: list[SiteCounters]


def fleet_stats(store: Store) -> FleetStats:
    active = [s.value for s in ACTIVE_REQUEST_STATUSES]
    with store.read() as conn:
        queue = {(r.tier, r.status): int(r.n) for r in conn.execute(
            select(requests.c.tier, requests.c.status, func.count().label("n"))
            .where(requests.c.status.in_(active))
            .group_by(requests.c.tier, requests.c.status))}
        rows = conn.execute(select(
            sites.c.name, sites.c.chip, sites.c.tokens_generated, sites.c.completions,
            sites.c.leases_granted, sites.c.leases_expired, sites.c.stale_completions,
            sites.c.usage_rejections, sites.c.wasted_tokens, sites.c.cost_usd, sites.c.billed_usd)
            .order_by(sites.c.name)).all()
    return FleetStats(queue, [SiteCounters(
        name=r.name, chip=r.chip, tokens_generated=int(r.tokens_generated),
        completions=int(r.completions), leases_granted=int(r.leases_granted),
        leases_expired=int(r.leases_expired), stale_completions=int(r.stale_completions),
        usage_rejections=int(r.usage_rejections or 0),
        wasted_tokens=int(r.wasted_tokens), cost_usd=float(r.cost_usd),
        billed_usd=float(r.billed_usd)) for r in rows])
