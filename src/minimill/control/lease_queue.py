"""The head of the queue a lease call reads: each tenant's first queued requests, and what
fair share between tenants needs (the tokens each holds leased, its weight).

A window of the whole queue in arrival order would hold only the heavy tenant's requests
while it has thousands queued, and placement could not offer the light tenant's. So each
tenant's queue is read on its own (up to the window each, those with the least leased first;
an index per tenant keeps every read short). With one tenant queued it is the plain window.
Rows are locked (`FOR UPDATE SKIP LOCKED` on PostgreSQL) as the lease call reads them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Float, Integer, Select, String, bindparam, func, select

from minimill.control import tenant_limits
from minimill.control.placement import Candidate
from minimill.control.records import RequestStatus, Tier
from minimill.control.release import remaining_tokens
from minimill.control.tables import requests
from minimill.control.tenant_limits import TenantLimits
from minimill.transport.protocol import session_tag

_QUEUED = RequestStatus.QUEUED.value
_LEASED = RequestStatus.LEASED.value
# Most tenants whose queues one lease call reads (the least served first), of the first
# MAX_TENANTS_SCANNED found with work queued.
MAX_TENANTS_READ = 64
MAX_TENANTS_SCANNED = 1024


@dataclass(frozen=True, slots=True)
class QueueHead:
    candidates: tuple[Candidate, ...]
    tenant_load: dict[str, float] = field(default_factory=dict)
    tenant_weights: dict[str, float] = field(default_factory=dict)


# The statements a lease call runs, built once (building them cost more than running them).
_FIRST_TENANT = (select(requests.c.tenant_id)
                 .where(requests.c.status == _QUEUED,
                        requests.c.tier == bindparam("b_tier", type_=String()))
                 .order_by(requests.c.tenant_id).limit(1))
_NEXT_TENANT = _FIRST_TENANT.where(requests.c.tenant_id > bindparam("b_after", type_=String()))
_ANY_QUEUED = select(requests.c.id).where(requests.c.status == _QUEUED).limit(1)


def _queued_tenants(conn: Connection, tier: Tier) -> list[str]:
    """Tenants with work of the tier queued: one index seek per tenant (a loose index scan
    over ix_requests_tenant_queue), not a pass over every queued row."""
    found: list[str] = []
    while len(found) < MAX_TENANTS_SCANNED:
        following = conn.execute(_NEXT_TENANT if found else _FIRST_TENANT,
                                 {"b_tier": tier.value,
                                  "b_after": found[-1] if found else None}).scalar()
        if following is None:
            break
        found.append(str(following))
    return found


def any_queued(conn: Connection) -> bool:
    """Whether any request waits in the queue (one index seek)."""
    return conn.execute(_ANY_QUEUED).first() is not None


def _leased_tokens(conn: Connection, default_tokens: int) -> dict[str, float]:
    """Tokens each tenant holds leased now: what fair share counts as its service."""
    rows = conn.execute(
        select(requests.c.tenant_id,
               func.sum(func.coalesce(requests.c.max_tokens, default_tokens)).label("tokens"))
        .where(requests.c.status == _LEASED).group_by(requests.c.tenant_id))
    return {r.tenant_id: float(r.tokens or 0) for r in rows}


def _candidates(conn: Connection, tier: Tier, models: list[str], limit: int, now: float,
                tenant_id: str | None = None) -> list[Candidate]:
    """Queued work a site may get (of one tenant, if named). Work past its deadline is not
    handed out: the janitor expires it (a batch past its window expires, it does not complete
    late)."""
    params = {"b_models": models, "b_now": now, "b_limit": limit, "b_tenant": tenant_id}
    return [Candidate(request_id=r.id, tier=tier, model=r.model, seq=r.seq, deadline=r.deadline,
                      remaining_tokens=remaining_tokens(r.max_tokens, r.checkpoint_tokens),
                      session=session_tag(r.session_key) if r.session_key else None,
                      tenant=r.tenant_id)
            for r in conn.execute(_candidates_query(tier, tenant_id is not None), params)]


def count_background(conn: Connection, models: list[str], now: float, limit: int) -> int:
    """Queued background requests a site serving `models` could get, counted up to `limit`
    (an index range, no rows built)."""
    return int(conn.execute(_COUNT_BACKGROUND, {"b_models": models, "b_now": now,
                                                "b_limit": limit}).scalar_one())


_COUNT_BACKGROUND = select(func.count()).select_from(
    select(requests.c.id)
    .where(requests.c.status == _QUEUED, requests.c.tier == Tier.BACKGROUND.value,
           requests.c.model.in_(bindparam("b_models", expanding=True)),
           requests.c.deadline >= bindparam("b_now", type_=Float()))
    .limit(bindparam("b_limit", type_=Integer())).subquery())


@functools.cache
def _candidates_query(tier: Tier, of_one_tenant: bool) -> Select[Any]:
    """The queue read of `_candidates` (parameters b_models, b_now, b_limit, b_tenant)."""
    order = (requests.c.seq,) if tier == Tier.REALTIME else (requests.c.deadline, requests.c.seq)
    query = (select(requests.c.id, requests.c.model, requests.c.seq, requests.c.deadline,
                    requests.c.max_tokens, requests.c.checkpoint_tokens, requests.c.session_key,
                    requests.c.tenant_id)
             .where(requests.c.status == _QUEUED, requests.c.tier == tier.value,
                    requests.c.model.in_(bindparam("b_models", expanding=True)),
                    requests.c.deadline >= bindparam("b_now", type_=Float())))
    if of_one_tenant:
        query = query.where(requests.c.tenant_id == bindparam("b_tenant", type_=String()))
    return (query.order_by(*order).limit(bindparam("b_limit", type_=Integer()))
            .with_for_update(skip_locked=True))


def read(conn: Connection, models: list[str], window: int, now: float, default_tokens: int,
         default_weight: float = 1.0) -> QueueHead:
    """Up to `window` queued requests per tier and tenant, and the tenants' load and weights
    when more than one tenant has work queued."""
    by_tier = {tier: _queued_tenants(conn, tier) for tier in (Tier.REALTIME, Tier.BACKGROUND)}
    if all(len(t) <= 1 for t in by_tier.values()):
        return QueueHead((*_candidates(conn, Tier.REALTIME, models, window, now),
                          *_candidates(conn, Tier.BACKGROUND, models, window, now)))
    load = _leased_tokens(conn, default_tokens)
    pool: list[Candidate] = []
    for tier, tenant_ids in by_tier.items():
        if len(tenant_ids) <= 1:
            pool += _candidates(conn, tier, models, window, now)
            continue
        for tenant_id in sorted(tenant_ids, key=lambda t: (load.get(t, 0.0), t))[
                :MAX_TENANTS_READ]:
            pool += _candidates(conn, tier, models, window, now, tenant_id)
    defaults = TenantLimits(weight=default_weight)
    weights = {t: limits.weight for t, limits in tenant_limits.of_tenants(
        conn, {c.tenant for c in pool if c.tenant is not None}, defaults).items()}
    return QueueHead(tuple(pool), load, weights)
