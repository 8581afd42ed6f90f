"""Realtime requests: submit one, read its progress and result, cancel it when nobody waits."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, bindparam, insert, select, update

from minimill.control import checkpoints, rate_limits
from minimill.control.body_rules import PreparedBody
from minimill.control.config import ControlConfig
from minimill.control.errors import NotFoundError
from minimill.control.prompt_count import PromptCount, count_prompts, num_choices, of_prepared
from minimill.control.rate_limits import RateState
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
from minimill.control.tenant_limits import TenantLimits
from minimill.transport.protocol import Checkpoint

_rng = random.SystemRandom()


def new_seed() -> int:
    """A seed for a body without one, fixed at creation so every resume samples the same."""
    return _rng.getrandbits(63)


# What a waiter reads on every wake: everything but the body, which may be large.
_WATCHED = [c for c in requests.c if c.name != "body"]


def record(row: Any, checkpoint: Checkpoint | None = None) -> RequestRecord:
    return RequestRecord(
        id=row.id, tenant_id=row.tenant_id, batch_id=row.batch_id,
        kind=Kind(row.kind) if row.kind else None, tier=Tier(row.tier), model=row.model,
        body=getattr(row, "body", None), status=RequestStatus(row.status), epoch=row.epoch,
        version=row.version, progress=row.progress, result=row.result, error=row.error,
        prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
        billed_usd=row.billed_usd, created_at=row.created_at, finished_at=row.finished_at,
        session_key=row.session_key, cached_tokens=row.cached_tokens or 0,
        checkpoint=checkpoint.model_dump(mode="json") if checkpoint is not None else None)


def record_with_checkpoint(conn: Connection, row: Any) -> RequestRecord:
    """The row's record with its checkpoint assembled (for a response's text so far)."""
    return record(row, checkpoints.load(conn, [row.id]).get(row.id) if row.progress else None)


def row_values(tenant_id: str, prepared: PreparedBody, now: float, deadline: float,
               tier: Tier, *, count_later: bool = False, **extra: Any) -> dict[str, Any]:
    """Column values of a new queued row (shared by realtime submit, responses and batch
    ingest), with the control plane's count of its prompt, or, with `count_later` (a batch's
    lines), none yet (prompt_count.count_uncounted makes it)."""
    counted = (PromptCount.later(num_choices(prepared.kind, prepared.body)) if count_later
               else count_prompts([of_prepared(prepared)])[0])
    return {**counted.columns(), "id": new_id("req_"), "tenant_id": tenant_id,
            "kind": prepared.kind.value,
            "tier": tier.value, "model": prepared.model, "body": prepared.body,
            "seed": prepared.seed if prepared.seed is not None else new_seed(),
            "max_tokens": prepared.max_tokens, "stream": prepared.stream,
            "status": RequestStatus.QUEUED.value, "epoch": 0, "attempts": 0, "version": 0,
            "prompt_tokens": 0, "completion_tokens": 0, "billed_usd": 0.0,
            "created_at": now, "deadline": deadline, "session_key": prepared.session_key,
            **extra}


def submit(store: Store, tenant_id: str, prepared: PreparedBody, now: float,
           config: ControlConfig, idempotency_key: str | None = None) -> str:
    """Queue a realtime (or flex) request; returns its id. With an idempotency key the
    tenant used before, the id of that earlier request (nothing new is queued)."""
    return submit_limited(store, tenant_id, prepared, now, config, idempotency_key)[0]


def admission_tokens(values: dict[str, Any]) -> int:
    """What a request takes from its tenant's tokens per minute: the prompt as counted at
    admission plus the most it may generate (max_tokens for each choice), as OpenAI counts."""
    choices = values.get("num_choices") or 1
    return int(values.get("counted_prompt_tokens") or 0) + int(values.get("max_tokens") or 0) \
        * int(choices)


@retry_conflicts
def submit_limited(store: Store, tenant_id: str, prepared: PreparedBody, now: float,
                   config: ControlConfig, idempotency_key: str | None = None,
                   limits: TenantLimits | None = None) -> tuple[str, RateState | None]:
    """`submit`, within the tenant's `limits` (rate_limits.py: a 429 queues nothing), and
    what is left of them for the answer's x-ratelimit-* headers."""
    values = row_values(tenant_id, prepared, now, now + config.realtime_timeout_s,
                        prepared.tier, idempotency_key=idempotency_key)
    state = None
    with store.write() as conn:
        if idempotency_key is not None:
            earlier = conn.execute(select(requests.c.id).where(
                requests.c.tenant_id == tenant_id,
                requests.c.idempotency_key == idempotency_key)).scalar()
            if earlier is not None:
                return str(earlier), None
        if limits is not None:
            state = rate_limits.admit(conn, tenant_id, admission_tokens(values), now, limits,
                                      realtime=prepared.tier == Tier.REALTIME)
        conn.execute(insert(requests).values(**values))
    return str(values["id"]), state


def get_request(store: Store, tenant_id: str, request_id: str, with_body: bool = True,
                with_checkpoint: bool = False) -> RequestRecord:
    """The request's row; without its body (None) for waiters that read it on every wake;
    with its checkpoint assembled if asked."""
    columns = requests.c if with_body else _WATCHED
    with store.read() as conn:
        row = conn.execute(select(*columns).where(requests.c.id == request_id,
                                                  requests.c.tenant_id == tenant_id)).first()
        if row is None:
            raise NotFoundError(f"No such request: {request_id}")
        return record_with_checkpoint(conn, row) if with_checkpoint else record(row)


def checkpoint_of(store: Store, tenant_id: str, request_id: str) -> Checkpoint | None:
    """The request's stored checkpoint, assembled (None when it has none)."""
    get_request(store, tenant_id, request_id, with_body=False)  # 404 for other tenants
    with store.read() as conn:
        return checkpoints.load(conn, [request_id]).get(request_id)


# Built once: a stream reads its row at every poll of every realtime stream, and building
# this SELECT of every column took half of the read's CPU.
_WATCHED_ROW = select(*_WATCHED).where(requests.c.id == bindparam("request_id"),
                                       requests.c.tenant_id == bindparam("tenant_id"))


def read_stream(store: Store, tenant_id: str, request_id: str,
                after_seq: int) -> tuple[RequestRecord, list[tuple[int, dict[str, Any]]]]:
    """The row (without its body) and the checkpoint chunks after `after_seq`, in one
    snapshot: a stream reads only what is new since its last read."""
    with store.read() as conn:
        row = conn.execute(_WATCHED_ROW, {"request_id": request_id,
                                          "tenant_id": tenant_id}).first()
        if row is None:
            raise NotFoundError(f"No such request: {request_id}")
        chunks = [] if row.progress is None else checkpoints.since(conn, request_id, after_seq)
    return record(row), chunks


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
                    version=requests.c.version + 1, progress=None,
                    error={"code": "cancelled", "message": reason, "source": "cancel"}))
        if done.rowcount:
            checkpoints.drop(conn, [request_id])
    return bool(done.rowcount)


@retry_conflicts
def expire_overdue(store: Store, now: float) -> int:
    """Realtime (and flex) requests past their deadline expire; their waiters answer 504."""
    with store.write() as conn:
        expired = conn.execute(
            update(requests)
            .where(requests.c.status.in_([s.value for s in ACTIVE_REQUEST_STATUSES]),
                   requests.c.deadline < now, requests.c.batch_id.is_(None))
            .values(status=RequestStatus.EXPIRED.value, finished_at=now,
                    lease_expires_at=None, version=requests.c.version + 1, progress=None,
                    error={"code": "timeout", "source": "timeout",
                           "message": "no worker finished the request in time"})
            .returning(requests.c.id)).scalars().all()
        checkpoints.drop(conn, expired)
    return len(expired)
