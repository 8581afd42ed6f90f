"""Webhook endpoints: where events are delivered (webhook_events.py records and delivers them).

A tenant's endpoint receives that tenant's events. An operator may register a fleet-wide one
(tenant None; `minimill webhooks create --fleet`) that receives the events of every tenant, for
the operator's own bookkeeping: event payloads carry only an id and a type, so it reveals no
tenant's content. The signing secret is returned once, at creation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import Connection, and_, delete, insert, or_, select

from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.records import new_id
from minimill.control.store import Store
from minimill.control.tables import tenants, webhook_deliveries, webhook_endpoints
from minimill.control.url_guard import check_reachable
from minimill.control.webhook_signing import new_secret, secret_hint

EVENT_TYPES = ("response.completed", "response.failed", "response.cancelled",
               "response.incomplete", "batch.completed", "batch.failed", "batch.expired",
               "batch.cancelled")
MAX_URL_CHARS = 2000
MAX_NAME_CHARS = 200


@dataclass(frozen=True, slots=True)
class WebhookEndpoint:
    id: str
    tenant_id: str | None  # None: fleet-wide (an operator's), every tenant's events
    name: str
    url: str
    event_types: tuple[str, ...]
    created_at: float
    secret_hint: str


def _record(row: Any) -> WebhookEndpoint:
    return WebhookEndpoint(id=row.id, tenant_id=row.tenant_id, name=row.name, url=row.url,
                           event_types=tuple(row.event_types), created_at=row.created_at,
                           secret_hint=secret_hint(row.secret))


def check_url(url: str) -> str:
    url = url.strip()
    parts = urlsplit(url)
    if (len(url) > MAX_URL_CHARS or parts.scheme not in ("http", "https") or not parts.hostname
            or any(c.isspace() for c in url)):
        raise InvalidRequestError("url must be an http:// or https:// URL with a host, at most "
                                  f"{MAX_URL_CHARS} characters", param="url")
    return url


def check_event_types(event_types: list[str]) -> tuple[str, ...]:
    unknown = [t for t in event_types if t not in EVENT_TYPES]
    if not event_types or unknown:
        raise InvalidRequestError(f"event_types: a non-empty list of {', '.join(EVENT_TYPES)}"
                                  + (f"; unknown: {', '.join(unknown)}" if unknown else ""),
                                  param="event_types")
    return tuple(dict.fromkeys(event_types))


def create_endpoint(store: Store, tenant_id: str | None, name: str, url: str,
                    event_types: list[str], *,
                    allow_private: bool = False) -> tuple[WebhookEndpoint, str]:
    """A new endpoint and its signing secret (shown once). Its URL must reach a public
    address unless `allow_private` (url_guard.py); deliveries check again."""
    name = name.strip()
    if not 1 <= len(name) <= MAX_NAME_CHARS:
        raise InvalidRequestError(f"name must have 1 to {MAX_NAME_CHARS} characters",
                                  param="name")
    url = check_url(url)
    check_reachable(url, allow_private)
    values = {"id": new_id("we_"), "tenant_id": tenant_id, "name": name, "url": url,
              "secret": new_secret(), "event_types": list(check_event_types(event_types)),
              "created_at": time.time()}
    with store.write() as conn:
        conn.execute(insert(webhook_endpoints).values(**values))
        row = conn.execute(select(webhook_endpoints)
                           .where(webhook_endpoints.c.id == values["id"])).one()
    return _record(row), str(values["secret"])


def _newest_first(conn: Connection, where: Any, after: str | None,
                  limit: int) -> tuple[list[Any], bool]:
    query = select(webhook_endpoints).where(where)
    if after is not None:
        cursor = conn.execute(select(webhook_endpoints.c.created_at)
                              .where(where, webhook_endpoints.c.id == after)).first()
        if cursor is None:
            raise NotFoundError(f"No such webhook endpoint: {after}", param="after")
        query = query.where(or_(webhook_endpoints.c.created_at < cursor.created_at,
                                and_(webhook_endpoints.c.created_at == cursor.created_at,
                                     webhook_endpoints.c.id < after)))
    rows = conn.execute(query.order_by(webhook_endpoints.c.created_at.desc(),
                                       webhook_endpoints.c.id.desc()).limit(limit + 1)).all()
    return list(rows[:limit]), len(rows) > limit


def list_endpoints(store: Store, tenant_id: str, *, after: str | None = None,
                   limit: int = 20) -> tuple[list[WebhookEndpoint], bool]:
    """A tenant's endpoints, newest first."""
    with store.read() as conn:
        rows, more = _newest_first(conn, webhook_endpoints.c.tenant_id == tenant_id, after,
                                   limit)
    return [_record(r) for r in rows], more


def all_endpoints(store: Store) -> list[tuple[WebhookEndpoint, str | None]]:
    """Every endpoint with its tenant's name (None: fleet-wide), for the operator."""
    query = (select(webhook_endpoints, tenants.c.name.label("tenant_name"))
             .outerjoin(tenants, tenants.c.id == webhook_endpoints.c.tenant_id)
             .order_by(webhook_endpoints.c.created_at))
    with store.read() as conn:
        return [(_record(r), r.tenant_name) for r in conn.execute(query)]


def get_endpoint(store: Store, tenant_id: str, endpoint_id: str) -> WebhookEndpoint:
    with store.read() as conn:
        row = conn.execute(select(webhook_endpoints).where(
            webhook_endpoints.c.id == endpoint_id,
            webhook_endpoints.c.tenant_id == tenant_id)).first()
    if row is None:
        raise NotFoundError(f"No such webhook endpoint: {endpoint_id}",
                            param="webhook_endpoint_id")
    return _record(row)


def _delete(store: Store, where: Any, endpoint_id: str) -> None:
    with store.write() as conn:
        gone = conn.execute(delete(webhook_endpoints).where(
            webhook_endpoints.c.id == endpoint_id, where)).rowcount
        if not gone:
            raise NotFoundError(f"No such webhook endpoint: {endpoint_id}",
                                param="webhook_endpoint_id")
        # Its undelivered events go with it: nobody is there to receive them.
        conn.execute(delete(webhook_deliveries).where(
            webhook_deliveries.c.endpoint_id == endpoint_id,
            webhook_deliveries.c.status == "pending"))


def delete_endpoint(store: Store, tenant_id: str, endpoint_id: str) -> None:
    """Delete one of the tenant's endpoints."""
    _delete(store, webhook_endpoints.c.tenant_id == tenant_id, endpoint_id)


def delete_any_endpoint(store: Store, endpoint_id: str) -> None:
    """Delete any endpoint, fleet-wide or a tenant's (the operator's command line)."""
    _delete(store, webhook_endpoints.c.id == endpoint_id, endpoint_id)
