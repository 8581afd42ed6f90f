"""Each tenant's limits and settings: the operator's defaults (ControlConfig.tenant_limits,
from `minimill serve --tenant-*` or MINIMILL_TENANT_*) with the tenant's own overrides from the
store (`minimill tenants set`, `POST /v1/tenants/{name}/limits`).

Limits (None: unlimited): requests and tokens per minute (rate_limits.py), realtime requests
queued or running at once, live boxes, unfinished agents, and bytes of stored files (quotas.py).
Settings: the tenant's weight in placement's fair share between tenants (a tenant of weight 2
gets twice the service of one of weight 1 while both have work queued), and whether its
prompts may share KV prefix blocks with other tenants' (off: its cached prefixes are its own,
so no tenant can learn from `cached_tokens` what another sent).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from sqlalchemy import Connection, insert, select, update

from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.store import Store
from minimill.control.tables import tenant_limits, tenants


@dataclass(frozen=True, slots=True)
class TenantLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt (as counted at admission) plus max_tokens
    max_concurrent_realtime: int | None = None  # realtime requests queued or leased at once
    max_boxes: int | None = None  # boxes not deleted
    max_agents: int | None = None  # agents not finished
    max_stored_bytes: int | None = None  # bytes of the tenant's files (uploads and outputs)
    weight: float = 1.0  # share of service while tenants compete (placement.fair_order)
    share_prefix_cache: bool = False  # its prompts' cached prefixes serve other tenants too

    def __post_init__(self) -> None:
        for name in LIMIT_NAMES:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise InvalidRequestError(f"{name} must be a whole number >= 0 or null "
                                          "(unlimited)", param=name)
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float) \
                or not 0 < self.weight <= 1000:
            raise InvalidRequestError("weight must be a number in (0, 1000]", param="weight")
        if not isinstance(self.share_prefix_cache, bool):
            raise InvalidRequestError("share_prefix_cache must be true or false",
                                      param="share_prefix_cache")

    def cache_salt(self, tenant_id: str) -> str | None:
        """What the engine mixes into the tenant's prefix-block hashes (None: shared)."""
        return None if self.share_prefix_cache else f"tenant:{tenant_id}"


FIELD_NAMES = tuple(f.name for f in fields(TenantLimits))
LIMIT_NAMES = tuple(n for n in FIELD_NAMES if n not in ("weight", "share_prefix_cache"))
UNLIMITED = TenantLimits()


@dataclass(frozen=True, slots=True)
class TenantLimitsView:
    """A tenant's limits in effect, and which of them it has of its own."""

    tenant: str
    limits: TenantLimits
    overrides: dict[str, Any]


def check_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides with known names and valid values (a 400 naming the first bad one)."""
    for name in overrides:
        if name not in FIELD_NAMES:
            raise InvalidRequestError(f"Unknown limit {name!r}; known: {', '.join(FIELD_NAMES)}",
                                      param=name)
        if name in ("weight", "share_prefix_cache") and overrides[name] is None:
            raise InvalidRequestError(f"{name} cannot be null", param=name)
    replace(UNLIMITED, **overrides)  # validates the values
    return dict(overrides)


def effective(defaults: TenantLimits, overrides: Mapping[str, Any] | None) -> TenantLimits:
    known = {k: v for k, v in (overrides or {}).items() if k in FIELD_NAMES}
    return replace(defaults, **known) if known else defaults


def _tenant_id(conn: Connection, name: str) -> str:
    found = conn.execute(select(tenants.c.id).where(tenants.c.name == name)).scalar()
    if found is None:
        raise NotFoundError(f"No such tenant: {name!r}", param="tenant", code="tenant_not_found")
    return str(found)


def overrides_of(conn: Connection, tenant_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The stored overrides of each of these tenants that has any."""
    ids = list(set(tenant_ids))
    found: dict[str, dict[str, Any]] = {}
    for start in range(0, len(ids), 500):
        rows = conn.execute(select(tenant_limits.c.tenant_id, tenant_limits.c.overrides)
                            .where(tenant_limits.c.tenant_id.in_(ids[start:start + 500])))
        found.update({r.tenant_id: dict(r.overrides or {}) for r in rows})
    return found


def limits_for(store: Store, tenant_id: str, defaults: TenantLimits) -> TenantLimits:
    """The limits in effect for a tenant (one small read)."""
    with store.read() as conn:
        return effective(defaults, overrides_of(conn, [tenant_id]).get(tenant_id))


def of_tenants(conn: Connection, tenant_ids: Iterable[str],
               defaults: TenantLimits) -> dict[str, TenantLimits]:
    ids = set(tenant_ids)
    stored = overrides_of(conn, ids)
    return {t: effective(defaults, stored.get(t)) for t in ids}


def view(store: Store, tenant: str, defaults: TenantLimits) -> TenantLimitsView:
    with store.read() as conn:
        tenant_id = _tenant_id(conn, tenant)
        own = overrides_of(conn, [tenant_id]).get(tenant_id, {})
    return TenantLimitsView(tenant=tenant, limits=effective(defaults, own), overrides=own)


def list_views(store: Store, defaults: TenantLimits) -> list[TenantLimitsView]:
    with store.read() as conn:
        rows = conn.execute(select(tenants.c.id, tenants.c.name).order_by(tenants.c.name)).all()
        stored = overrides_of(conn, [r.id for r in rows])
    return [TenantLimitsView(tenant=r.name, limits=effective(defaults, stored.get(r.id)),
                             overrides=stored.get(r.id, {})) for r in rows]


def set_overrides(store: Store, tenant: str, changes: Mapping[str, Any], clear: Iterable[str],
                  defaults: TenantLimits) -> TenantLimitsView:
    """Merge `changes` into the tenant's overrides and drop those named in `clear` (they take
    the operator's defaults again)."""
    changes = check_overrides(changes)
    dropped = set(clear)
    for name in dropped:
        if name not in FIELD_NAMES:
            raise InvalidRequestError(f"Unknown limit {name!r}", param=name)
    now = time.time()
    with store.write() as conn:
        tenant_id = _tenant_id(conn, tenant)
        existing = overrides_of(conn, [tenant_id]).get(tenant_id)
        merged = {k: v for k, v in {**(existing or {}), **changes}.items() if k not in dropped}
        effective(defaults, merged)  # the merged whole is valid too
        if existing is None:
            conn.execute(insert(tenant_limits).values(tenant_id=tenant_id, overrides=merged,
                                                      updated_at=now))
        else:
            conn.execute(update(tenant_limits).where(tenant_limits.c.tenant_id == tenant_id)
                         .values(overrides=merged, updated_at=now))
    return TenantLimitsView(tenant=tenant, limits=effective(defaults, merged), overrides=merged)


def as_dict(limits: TenantLimits) -> dict[str, Any]:
    return asdict(limits)
