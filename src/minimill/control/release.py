"""Leases given back before they finish: the worker's release, and the handback list that a
heartbeat answer carries ahead of an announced outage (policy in handback.py).

A release at the lease's current epoch, from the site that holds it, sends the row back to
`queued` at once with the sent checkpoint: the next worker resumes from there, nothing is
recomputed and nobody waits for an expiry. A release that arrives after the lease expired, the
row still queued at that epoch (nobody leased it since), still stores its newer checkpoint.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select, update

from minimill.control import checkpoints, lease_rules
from minimill.control.config import ControlConfig
from minimill.control.handback import handback_due
from minimill.control.placement import Candidate, PlacementPolicy
from minimill.control.records import RequestStatus, Site, Tier
from minimill.control.site_view import site_states
from minimill.control.sites import touch_site
from minimill.control.store import JsonText, Store, retry_conflicts
from minimill.control.tables import outages, requests
from minimill.transport.protocol import ReleaseItem, ReleaseRequest, ReleaseResponse

_QUEUED = RequestStatus.QUEUED.value
_LEASED = RequestStatus.LEASED.value
_MAX_EPOCH = 2**31 - 1


def remaining_tokens(max_tokens: int | None, checkpoint_tokens: int) -> int | None:
    """Tokens a request may still generate (None: no limit but the context), given what its
    stored checkpoint holds (`requests.checkpoint_tokens`)."""
    if max_tokens is None:
        return None
    return max(max_tokens - checkpoint_tokens, 1)


@retry_conflicts
def release(store: Store, site: Site, request: ReleaseRequest, now: float,
            config: ControlConfig) -> ReleaseResponse:
    """Queue the released leases again with their checkpoints."""
    released: list[str] = []
    rejected: list[str] = []
    # The checkpoints sent, encoded before the write transaction opens.
    encoded = {id(item): [checkpoints.payload(c) for c in item.checkpoint.choices]
               for item in request.leases if item.checkpoint is not None}
    with store.write() as conn:
        items = list(request.leases)
        if request.all_held:
            named = {item.request_id for item in items}
            items += [ReleaseItem(request_id=r.id, epoch=r.epoch) for r in conn.execute(
                select(requests.c.id, requests.c.epoch)
                .where(requests.c.site_id == site.id,
                       requests.c.status.in_([s.value for s in lease_rules.HELD])))
                if r.id not in named]
        for item in items:
            if not 0 <= item.epoch <= _MAX_EPOCH:
                rejected.append(item.request_id)
                continue
            mine = (requests.c.id == item.request_id, requests.c.epoch == item.epoch,
                    requests.c.site_id == site.id)
            values: dict[str, Any] = {"version": requests.c.version + 1}
            chunk: JsonText | None = None
            if item.checkpoint is not None:  # the whole progress, in place of what is stored
                stored, chunk = checkpoints.replacement(conn, item.request_id, item.checkpoint,
                                                        encoded.get(id(item)))
                values.update(stored)
            hit = conn.execute(
                update(requests)
                .where(*mine, requests.c.status.in_([s.value for s in lease_rules.HELD]))
                .values(status=_QUEUED, lease_id=None, lease_expires_at=None, **values)
            ).rowcount
            if not hit:  # expired meanwhile: still ours if nobody leased it since
                hit = conn.execute(update(requests).where(*mine, requests.c.status == _QUEUED)
                                   .values(**values)).rowcount
            if hit and chunk is not None:
                checkpoints.put(conn, item.request_id, values, chunk)
            (released if hit else rejected).append(item.request_id)
        touch_site(conn, site.id, now, config.lease_ttl_s)
    return ReleaseResponse(released=released, rejected=rejected)


def handback_for(conn: Connection, site_id: str, now: float,
                 policy: PlacementPolicy) -> list[str]:
    """Leases the site should hand back now (empty unless an outage of it is near)."""
    near = conn.execute(
        select(outages.c.id).where(outages.c.site_id == site_id, outages.c.end_at > now,
                                   outages.c.start_at <= now + policy.handback_horizon_s)
        .limit(1)).first()
    if near is None:
        return []
    states = site_states(conn)
    held = [Candidate(request_id=r.id, tier=Tier(r.tier), model=r.model, seq=r.seq,
                      deadline=r.deadline,
                      remaining_tokens=remaining_tokens(r.max_tokens, r.checkpoint_tokens))
            for r in conn.execute(
                select(requests.c.id, requests.c.tier, requests.c.model, requests.c.seq,
                       requests.c.deadline, requests.c.max_tokens,
                       requests.c.checkpoint_tokens)
                .where(requests.c.site_id == site_id, requests.c.status == _LEASED))]
    return handback_due(states[site_id], held, list(states.values()), now, policy)
