"""Site health as placement and operators see it: pure functions of a SiteState and a clock.

Definitions (the same numbers drive placement and `minimill sites list`):

- Observed uptime: the fraction of the time since the site's first contact during which it was
  seen alive. Every lease, heartbeat or completion call is a contact; a gap between two
  contacts of at most one lease TTL counts as up (`sites.touch_site` adds it to `up_s`), a
  longer gap counts as down. The silence since the last contact is not judged until it is
  longer than `alive_within_s`; then all of it counts as down. Announced outages are left out
  of the time span: a site that is dark when it said it would be is not unreliable.
- Expected loss fraction: the share of work placed on the site that is expected to be lost,
  the larger of its expired-lease share (expired / (granted + prior_leases), so that a new
  site is not judged on its first two leases) and its observed down fraction (1 - uptime).
- Effective $/Mtok: $/Mtok at the busy throughput its worker reports (metering: placement's
  prior, never a bill or a cost) divided by (1 - expected loss):
  lost work is paid for and then done again elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minimill.control import metering

if TYPE_CHECKING:
    from minimill.control.placement import PlacementPolicy, SiteState


def in_outage(site: SiteState, now: float) -> bool:
    return any(o.start_at <= now < o.end_at for o in site.outages)


def draining(site: SiteState, now: float, policy: PlacementPolicy) -> bool:
    """An outage starts soon enough that placement holds back work that would not finish."""
    return not in_outage(site, now) and any(
        now < o.start_at <= now + policy.drain_horizon_s for o in site.outages)


def alive(site: SiteState, now: float, policy: PlacementPolicy) -> bool:
    """Heard from recently and not in an announced outage."""
    return (site.last_seen_at is not None and now - site.last_seen_at <= policy.alive_within_s
            and not in_outage(site, now))


def free_slots(site: SiteState, now: float, policy: PlacementPolicy) -> int:
    """Free capacity the site reported recently (0 if its report is stale or it is down)."""
    if site.capacity_at is None or now - site.capacity_at > policy.capacity_fresh_s:
        return 0
    return max(site.free_capacity, 0) if alive(site, now, policy) else 0


def announced_down_s(site: SiteState, start: float, end: float) -> float:
    """Seconds of [start, end] covered by the site's announced outages (overlaps merged)."""
    spans = sorted((max(o.start_at, start), min(o.end_at, end)) for o in site.outages)
    total, open_start, open_end = 0.0, 0.0, None
    for s, e in spans:
        if e <= s:
            continue
        if open_end is None or s > open_end:
            if open_end is not None:
                total += open_end - open_start
            open_start, open_end = s, e
        else:
            open_end = max(open_end, e)
    if open_end is not None:
        total += open_end - open_start
    return total


def uptime(site: SiteState, now: float, policy: PlacementPolicy) -> float | None:
    """Observed fraction of time up since first contact (None: not enough contact yet)."""
    if site.first_seen_at is None or site.last_seen_at is None:
        return None
    quiet = now - site.last_seen_at <= policy.alive_within_s
    end = site.last_seen_at if quiet else now
    span = end - site.first_seen_at - announced_down_s(site, site.first_seen_at, end)
    if span <= 0:
        return None
    return min(1.0, max(0.0, site.up_s / span))


def loss_fraction(site: SiteState, now: float, policy: PlacementPolicy) -> float:
    """Expected fraction of the work placed on the site that will be lost."""
    expired = site.leases_expired / (max(site.leases_granted, 0) + policy.prior_leases)
    up = uptime(site, now, policy)
    down = 0.0 if up is None else 1.0 - up
    return min(policy.max_loss, max(expired, down, 0.0))


def busy_tokens_per_s(site: SiteState) -> float:
    """The site's busy throughput, or the default assumed until it is measured."""
    return metering.effective_tokens_per_s(site.tokens_per_s)


def expected_tokens_per_s(site: SiteState, now: float, policy: PlacementPolicy) -> float:
    """Throughput that turns into kept work: busy throughput less the expected loss."""
    return busy_tokens_per_s(site) * (1.0 - loss_fraction(site, now, policy))


def effective_usd_per_mtok(site: SiteState, now: float, policy: PlacementPolicy) -> float:
    return metering.effective_usd_per_mtok(site.price_at(now), site.tokens_per_s,
                                           loss_fraction(site, now, policy))
