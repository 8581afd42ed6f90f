"""Which held leases a site hands back ahead of its announced outage: a pure policy, like
placement (no I/O, no clock of its own), so the live control plane and a simulator agree.

A lease the site would not finish before its handback time (`handback_lead_s` before the
outage starts) is handed back early when a peer has room to finish it, most work left first:
that peer starts on it at once instead of after the window. What is still held at the
handback time all goes back, room elsewhere or not: a checkpoint handed back loses nothing,
while a lease caught by the outage would wait for its expiry. The worker hears this in a
heartbeat answer, checkpoints those leases and releases them (leases.release); the rows are
queued again at once with their checkpoints, and placement gives them to sites that fit.

How long a held lease still needs is estimated from the site's measured busy throughput shared
among the leases it holds, never below placement's conservative per-request speed.
"""

from __future__ import annotations

from collections.abc import Sequence

from minimill.control import site_health
from minimill.control.placement import DEFAULT_POLICY, Candidate, PlacementPolicy, Plan, SiteState


def per_request_tokens_per_s(site: SiteState, policy: PlacementPolicy) -> float:
    """Tokens/s one of the site's requests makes: its busy rate over what it holds."""
    shared = site_health.busy_tokens_per_s(site) / max(site.in_flight, 1)
    return max(shared, policy.stream_tokens_per_s)


def handback_due(site: SiteState, held: Sequence[Candidate], sites: Sequence[SiteState],
                 now: float, policy: PlacementPolicy = DEFAULT_POLICY) -> list[str]:
    """Request ids `site` should checkpoint and give back now (`held`: its leased requests,
    `sites`: every site, for the peers' free room)."""
    outage = site.current_or_next_outage(now)
    if outage is None or not held or outage.start_at - now > policy.handback_horizon_s:
        return []
    cutoff = outage.start_at - policy.handback_lead_s
    if now >= cutoff:
        return [c.request_id for c in held]
    rate = per_request_tokens_per_s(site, policy)
    late = sorted((c for c in held if now + policy.tokens(c) / rate > cutoff),
                  key=lambda c: (-policy.tokens(c), c.seq))
    peers = [p for p in sites if p.site_id != site.site_id]
    plan = Plan(now, policy)
    return [c.request_id for c in late if plan.give(peers, c)]
