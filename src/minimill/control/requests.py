"""Realtime requests: submit one, read its progress and result, cancel it when nobody waits."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from sqlalchemy import insert, select, update

from minimill.control.bodies import PreparedBody
from minimill.control.config import ControlConfig
from minimill.control.errors import NotFoundError
from minimill.control.records import (
    ACTIVE_REQUEST_STATUSES,
    Kind,
    RequestRecord,
    RequestStatus,
    Tier,
    new_id,
)
from minimill.control.store import Store, retry_conflicts
from minimill.control.tables import requests

_rng = random.SystemRandom()


def new_seed() -> int:
    """A seed for a body without one, fixed at creation so every resume samples the same."""
    return _rng.getrandbits(63)


def record(row: Any) -> RequestRecord:
    return RequestRecord(
        id=row.id, tenant_id=row.tenant_id, batch_id=row.batch_id,
        kind=Kind(row.kind) if row.kind else None, tier=Tier(row.tier), model=row.model,
        body=row.body, status=RequestStatus(row.status), epoch=row.epoch, version=row.version,
        checkpoint=row.checkpoint, result=row.result, error=row.error,
        prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
        billed_usd=row.billed_usd, created_at=row.created_at, finished_at=row.finished_at,
        session_key=row.session_key, cached_tokens=row.cached_tokens or 0)


def row_values(tenant_id: str, prepared: PreparedBody, now: float, deadline: float,
               tier: Tier, **extra: Any) -> dict[str, Any]:
    """Column values of a new queued row (shared by realtime submit and batch ingest)."""
    return {"id": new_id("req_"), "tenant_id": tenant_id, "kind": prepared.kind.value,
            "tier": tier.value, "model": prepared.model, "body": prepared.body,
            "seed": prepared.seed if prepared.seed is not None else new_seed(),
            "max_tokens": prepared.max_tokens, "stream": prepared.stream,
            "status": RequestStatus.QUEUED.value, "epoch": 0, "attempts": 0, "version": 0,
            "prompt_tokens": 0, "completion_tokens": 0, "billed_usd": 0.0,
            "created_at": now, "deadline": deadline, "session_key": prepared.session_key,
            **extra}


def submit(store: Store, tenant_id: str, prepared: PreparedBody, now: float,
           config: ControlConfig) -> str:
    """Queue a realtime (or flex) request; returns its id."""
    values = row_values(tenant_id, prepared, now, now + config.realtime_timeout_s,
                        prepared.tier)
    with store.write() as conn:
        conn.execute(insert(requests).values(**values))
    return str(values["id"])


def get_request(store: Store, tenant_id: str, request_id: str) -> RequestRecord:
    with store.read() as conn:
        row = conn.execute(select(requests).where(requests.c.id == request_id,
                                                  requests.c.tenant_id == tenant_id)).first()
    if row is None:
        raise NotFoundError(f"No such request: {request_id}")
    return record(row)


def versions(store: Store, request_ids: Iterable[str]) -> dict[str, int]:
    """Current version of each request (watchers poll this to notice progress)."""
    ids = list(request_ids)
    out: dict[str, int] = {}
    with store.read() as conn:
        for start in range(0, len(ids), 500):
            query = select(requests.c.id, requests.c.version).where(
                requests.c.id.in_(ids[start:start + 500]))
            out.update({r.id: r.version for r in conn.execute(query)})
    return out


@retry_conflicts
def cancel_request(store: Store, request_id: str, now: float, reason: str) -> bool:
    """Cancel a request that is still queued or leased (its lease is then revoked)."""
    with store.write() as conn:
        done = conn.execute(
            update(requests)
            .where(requests.c.id == request_id,
                   requests.c.status.in_([s.value for s in ACTIVE_REQUEST_STATUSES]))
            .values(status=RequestStatus.CANCELLED.value, finished_at=now,
                    version=requests.c.version + 1,
                    error={"code": "cancelled", "message": reason, "source": "cancel"}))
    return bool(done.rowcount)


@retry_conflicts
def expire_overdue(store: Store, now: float) -> int:
    """Realtime (and flex) requests past their deadline expire; their waiters answer 504."""
    with store.write() as conn:
        done = conn.execute(
            update(requests)
            .where(requests.c.status.in_([s.value for s in ACTIVE_REQUEST_STATUSES]),
                   requests.c.deadline < now, requests.c.batch_id.is_(None))
            .values(status=RequestStatus.EXPIRED.value, finished_at=now,
                    lease_expires_at=None, version=requests.c.version + 1,
                    error={"code": "timeout", "source": "timeout",
                           "message": "no worker finished the request in time"}))
    return int(done.rowcount)
