"""Webhook events and their delivery state, all in the store (endpoints: webhooks.py).

- `watch`: a background response or a batch is watched from its creation (same transaction).
- `record_ended`: each watched object that has ended becomes one event, with one delivery per
  endpoint that subscribes to it. The watch row is deleted in the transaction that writes the
  event, so with several control planes exactly one of them records it.
- `claim_due`: a sender claims due deliveries by pushing their next attempt a claim's length
  ahead (a conditional UPDATE; `FOR UPDATE SKIP LOCKED` on PostgreSQL). A sender that dies
  mid-delivery leaves them due again when the claim runs out: delivery is at least once, and
  receivers drop duplicates by `webhook-id`, the event id.
- `record_attempt`: a 2xx ends a delivery; anything else retries with exponential backoff up to
  a cap, until the event is `webhook_max_age_s` old. So a receiver that was down gets every
  event once it is back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, update

from minimill.control.config import ControlConfig
from minimill.control.records import TERMINAL_REQUEST_STATUSES, BatchStatus, RequestStatus, new_id
from minimill.control.response_render import response_id
from minimill.control.store import Store, retry_conflicts
from minimill.control.tables import (
    batches,
    requests,
    webhook_deliveries,
    webhook_endpoints,
    webhook_events,
    webhook_watches,
)

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
# Most objects turned into events, and deliveries claimed, per call.
MAX_PER_CALL = 200
MAX_ERROR_CHARS = 1000
_RESPONSE_EVENTS = {RequestStatus.SUCCEEDED: "response.completed",
                    RequestStatus.FAILED: "response.failed",
                    RequestStatus.EXPIRED: "response.failed",
                    RequestStatus.CANCELLED: "response.cancelled"}
_BATCH_EVENTS = {BatchStatus.COMPLETED: "batch.completed", BatchStatus.FAILED: "batch.failed",
                 BatchStatus.EXPIRED: "batch.expired", BatchStatus.CANCELLED: "batch.cancelled"}


def watch(conn: Connection, subject_kind: str, subject_id: str, tenant_id: str,
          now: float) -> None:
    """Watch a background response (its request id) or a batch for its end; call inside the
    transaction that creates it."""
    conn.execute(insert(webhook_watches).values(subject_id=subject_id, subject_kind=subject_kind,
                                                tenant_id=tenant_id, created_at=now))


def unwatch(conn: Connection, subject_id: str) -> None:
    conn.execute(delete(webhook_watches).where(webhook_watches.c.subject_id == subject_id))


@dataclass(frozen=True, slots=True)
class _Ended:
    subject_id: str
    tenant_id: str
    type: str
    data_id: str  # the id the event names: resp_... or batch_...
    at: float


def _response_event(status: str, result: dict[str, Any] | None) -> str:
    choices = (result or {}).get("choices") or []
    if status == RequestStatus.SUCCEEDED and any(
            c.get("finish_reason") == "length" for c in choices if int(c.get("index", 0)) == 0):
        return "response.incomplete"
    return _RESPONSE_EVENTS[RequestStatus(status)]


def _ended(conn: Connection) -> list[_Ended]:
    w = webhook_watches
    responses = conn.execute(
        select(w.c.subject_id, w.c.tenant_id, requests.c.status, requests.c.result,
               requests.c.finished_at, w.c.created_at)
        .join(requests, requests.c.id == w.c.subject_id)
        .where(w.c.subject_kind == "response",
               requests.c.status.in_([s.value for s in TERMINAL_REQUEST_STATUSES]))
        .limit(MAX_PER_CALL)).all()
    ended_at = func.coalesce(batches.c.completed_at, batches.c.failed_at, batches.c.expired_at,
                             batches.c.cancelled_at, w.c.created_at)
    done = conn.execute(
        select(w.c.subject_id, w.c.tenant_id, batches.c.status, ended_at.label("at"))
        .join(batches, batches.c.id == w.c.subject_id)
        .where(w.c.subject_kind == "batch", batches.c.status.in_(list(_BATCH_EVENTS)))
        .limit(MAX_PER_CALL)).all()
    return ([_Ended(r.subject_id, r.tenant_id, _response_event(r.status, r.result),
                    response_id(r.subject_id), r.finished_at or r.created_at)
             for r in responses]
            + [_Ended(r.subject_id, r.tenant_id, _BATCH_EVENTS[BatchStatus(r.status)],
                      r.subject_id, r.at) for r in done])


@retry_conflicts
def record_ended(store: Store, now: float) -> int:
    """Turn watched objects that have ended into events and deliveries; returns how many
    events were recorded."""
    with store.read() as conn:
        ended = _ended(conn)
    if not ended:
        return 0
    recorded = 0
    with store.write() as conn:
        won = set(conn.execute(
            delete(webhook_watches)
            .where(webhook_watches.c.subject_id.in_([e.subject_id for e in ended]))
            .returning(webhook_watches.c.subject_id)).scalars().all())
        endpoints = conn.execute(select(webhook_endpoints.c.id, webhook_endpoints.c.tenant_id,
                                        webhook_endpoints.c.event_types)).all()
        for e in ended:
            targets = [p.id for p in endpoints if e.subject_id in won and e.type in p.event_types
                       and p.tenant_id in (None, e.tenant_id)]
            if not targets:
                continue  # nobody subscribes: nothing to keep
            event_id = new_id("evt_")
            payload = json.dumps({"id": event_id, "object": "event", "type": e.type,
                                  "created_at": int(e.at), "data": {"id": e.data_id}},
                                 separators=(",", ":"))
            conn.execute(insert(webhook_events).values(
                id=event_id, tenant_id=e.tenant_id, type=e.type, subject_id=e.subject_id,
                payload=payload, created_at=now))
            conn.execute(insert(webhook_deliveries), [
                {"id": new_id("whd_"), "event_id": event_id, "endpoint_id": endpoint_id,
                 "status": PENDING, "attempts": 0, "next_attempt_at": now, "created_at": now}
                for endpoint_id in targets])
            recorded += 1
    return recorded


@dataclass(frozen=True, slots=True)
class Delivery:
    """One claimed attempt to deliver an event to an endpoint."""

    id: str
    event_id: str  # the webhook-id header
    url: str
    secret: str
    payload: str  # the exact body, signed as it is
    attempts: int  # including this one
    created_at: float


@retry_conflicts
def claim_due(store: Store, now: float, claim_s: float,
              limit: int = MAX_PER_CALL) -> list[Delivery]:
    """Claim deliveries that are due: nobody else attempts them for `claim_s` seconds."""
    d = webhook_deliveries
    with store.write() as conn:
        due = conn.execute(select(d.c.id).where(d.c.status == PENDING, d.c.next_attempt_at <= now)
                           .order_by(d.c.next_attempt_at).limit(limit)
                           .with_for_update(skip_locked=True)).scalars().all()
        if not due:
            return []
        claimed = conn.execute(
            update(d).where(d.c.id.in_(due), d.c.status == PENDING, d.c.next_attempt_at <= now)
            .values(next_attempt_at=now + claim_s, attempts=d.c.attempts + 1)
            .returning(d.c.id)).scalars().all()
        rows = conn.execute(
            select(d.c.id, d.c.event_id, d.c.attempts, d.c.created_at, webhook_events.c.payload,
                   webhook_endpoints.c.url, webhook_endpoints.c.secret)
            .join(webhook_events, webhook_events.c.id == d.c.event_id)
            .join(webhook_endpoints, webhook_endpoints.c.id == d.c.endpoint_id)
            .where(d.c.id.in_(claimed))).all()
    return [Delivery(id=r.id, event_id=r.event_id, url=r.url, secret=r.secret,
                     payload=r.payload, attempts=r.attempts, created_at=r.created_at)
            for r in rows]


def backoff_s(attempts: int, base_s: float, cap_s: float) -> float:
    """Seconds before the next attempt after `attempts` failed ones: doubling, capped."""
    return min(cap_s, base_s * 2.0 ** min(max(attempts - 1, 0), 62))


@retry_conflicts
def record_attempt(store: Store, delivery: Delivery, now: float, error: str | None,
                   config: ControlConfig) -> None:
    """The outcome of one attempt: `error` None means the receiver answered 2xx."""
    d = webhook_deliveries
    with store.write() as conn:
        if error is None:
            conn.execute(update(d).where(d.c.id == delivery.id, d.c.status == PENDING)
                         .values(status=DELIVERED, delivered_at=now, last_error=None))
            return
        expired = now - delivery.created_at >= config.webhook_max_age_s
        delay = backoff_s(delivery.attempts, config.webhook_retry_base_s,
                          config.webhook_retry_cap_s)
        # Only while this attempt's claim holds: a later claimant's outcome is not overwritten.
        conn.execute(update(d).where(d.c.id == delivery.id, d.c.status == PENDING,
                                     d.c.attempts == delivery.attempts)
                     .values(status=FAILED if expired else PENDING,
                             next_attempt_at=now + delay, last_error=error[:MAX_ERROR_CHARS]))


def delivery_counts(store: Store) -> dict[str, dict[str, int]]:
    """Deliveries per endpoint and status (pending, delivered, failed)."""
    d = webhook_deliveries
    out: dict[str, dict[str, int]] = {}
    with store.read() as conn:
        for endpoint_id, status, count in conn.execute(
                select(d.c.endpoint_id, d.c.status, func.count())
                .group_by(d.c.endpoint_id, d.c.status)):
            out.setdefault(endpoint_id, {})[status] = int(count)
    return out
