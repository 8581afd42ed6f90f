"""Batches: create, retrieve, list, cancel.

Creating a batch only checks the request; its lines are queued by an ingester (batch_load.py),
in short transactions, while the batch is `validating`. Finalization (output and error files)
and expiry belong to batch_finalize.py, driven by the janitor.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, and_, func, insert, or_, select, update

from minimill.control import checkpoints
from minimill.control.config import ControlConfig
from minimill.control.errors import ConflictError, InvalidRequestError, NotFoundError
from minimill.control.files import get_file
from minimill.control.records import (
    ACTIVE_REQUEST_STATUSES,
    ENDPOINT_KINDS,
    BatchRecord,
    BatchStatus,
    RequestCounts,
    RequestStatus,
    UsageTotals,
    new_id,
)
from minimill.control.store import Store, retry_conflicts
from minimill.control.tables import batches, requests
from minimill.control.webhook_events import watch

_WINDOW = re.compile(r"^\s*(\d{1,6})\s*([hd])\s*$")
MIN_WINDOW_S = 24 * 3600
MAX_WINDOW_S = 365 * 24 * 3600
MAX_METADATA_PAIRS = 16


def parse_window(window: str) -> float:
    """"24h" (or longer: "48h", "7d") -> seconds."""
    match = _WINDOW.match(window)
    if not match:
        raise InvalidRequestError(f"completion_window must look like '24h', got {window!r}",
                                  param="completion_window")
    seconds = int(match.group(1)) * (3600 if match.group(2) == "h" else 86400)
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise InvalidRequestError("completion_window must be at least 24h and at most 365d",
                                  param="completion_window")
    return float(seconds)


def _check_metadata(metadata: dict[str, Any] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(f"metadata: at most {MAX_METADATA_PAIRS} pairs",
                                  param="metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise InvalidRequestError("metadata: keys up to 64 and string values up to 512 "
                                      "characters", param="metadata")


def _counts(conn: Connection, batch_ids: Sequence[str]) -> dict[str, tuple[RequestCounts,
                                                                           UsageTotals]]:
    """Request counts and usage totals per batch, aggregated from its rows."""
    acc: dict[str, list[float]] = {b: [0, 0, 0, 0, 0, 0.0] for b in batch_ids}
    if batch_ids:
        query = (select(requests.c.batch_id, requests.c.status, func.count(),
                        func.sum(requests.c.prompt_tokens), func.sum(requests.c.completion_tokens),
                        func.sum(requests.c.billed_usd))
                 .where(requests.c.batch_id.in_(list(batch_ids)))
                 .group_by(requests.c.batch_id, requests.c.status))
        for batch_id, status, count, prompt, completion, billed in conn.execute(query):
            a = acc[batch_id]
            a[0] += count
            if status == RequestStatus.SUCCEEDED:
                a[1] += count
            elif status not in ACTIVE_REQUEST_STATUSES:
                a[2] += count
            a[3] += prompt or 0
            a[4] += completion or 0
            a[5] += billed or 0.0
    return {b: (RequestCounts(total=int(a[0]), completed=int(a[1]), failed=int(a[2])),
                UsageTotals(prompt_tokens=int(a[3]), completion_tokens=int(a[4]),
                            billed_usd=float(a[5])))
            for b, a in acc.items()}


def _record(row: Any, counts: RequestCounts, usage: UsageTotals) -> BatchRecord:
    return BatchRecord(
        id=row.id, tenant_id=row.tenant_id, endpoint=row.endpoint,
        input_file_id=row.input_file_id, completion_window=row.completion_window,
        status=BatchStatus(row.status), created_at=row.created_at, expires_at=row.expires_at,
        in_progress_at=row.in_progress_at, finalizing_at=row.finalizing_at,
        completed_at=row.completed_at, failed_at=row.failed_at, expired_at=row.expired_at,
        cancelling_at=row.cancelling_at, cancelled_at=row.cancelled_at,
        output_file_id=row.output_file_id, error_file_id=row.error_file_id,
        errors=row.errors, metadata=row.metadata, counts=counts, usage=usage)


def get_batch(store: Store, tenant_id: str, batch_id: str) -> BatchRecord:
    with store.read() as conn:
        row = conn.execute(select(batches).where(batches.c.id == batch_id,
                                                 batches.c.tenant_id == tenant_id)).first()
        if row is None:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id")
        counts, usage = _counts(conn, [batch_id])[batch_id]
    return _record(row, counts, usage)


def list_batches(store: Store, tenant_id: str, after: str | None = None,
                 limit: int = 20) -> tuple[list[BatchRecord], bool]:
    """Newest first; `after` is the id of the last batch of the previous page."""
    query = select(batches).where(batches.c.tenant_id == tenant_id)
    with store.read() as conn:
        if after:
            cursor = conn.execute(select(batches.c.created_at).where(
                batches.c.id == after, batches.c.tenant_id == tenant_id)).first()
            if cursor is None:
                raise NotFoundError(f"No such Batch object: {after}", param="after")
            query = query.where(or_(batches.c.created_at < cursor.created_at,
                                    and_(batches.c.created_at == cursor.created_at,
                                         batches.c.id < after)))
        rows = conn.execute(query.order_by(batches.c.created_at.desc(), batches.c.id.desc())
                            .limit(limit + 1)).all()
        page = rows[:limit]
        totals = _counts(conn, [r.id for r in page])
    return [_record(r, *totals[r.id]) for r in page], len(rows) > limit


def create_batch(store: Store, tenant_id: str, input_file_id: str, endpoint: str,
                 completion_window: str, metadata: dict[str, Any] | None,
                 config: ControlConfig, now: float | None = None,
                 output_expires_after_s: int | None = None) -> BatchRecord:
    """Check the request and leave the batch `validating`: an ingester (batch_load.py) reads
    the input file and queues its lines, or fails the batch when the file is unusable."""
    if endpoint not in ENDPOINT_KINDS:
        raise InvalidRequestError(f"endpoint must be one of {', '.join(ENDPOINT_KINDS)}; got "
                                  f"{endpoint!r}", param="endpoint")
    window_s = parse_window(completion_window)
    _check_metadata(metadata)
    source = get_file(store, tenant_id, input_file_id)
    if source.purpose != "batch":
        raise InvalidRequestError(f"file {input_file_id} has purpose {source.purpose!r}, "
                                  "not 'batch'", param="input_file_id")
    now = time.time() if now is None else now
    values = {"id": new_id("batch_"), "tenant_id": tenant_id, "endpoint": endpoint,
              "input_file_id": input_file_id, "completion_window": completion_window,
              "created_at": now, "expires_at": now + window_s, "metadata": metadata,
              "output_expires_after_s": output_expires_after_s,
              "status": BatchStatus.VALIDATING.value}
    if source.bytes > config.max_file_bytes:
        values.update(status=BatchStatus.FAILED.value, failed_at=now, errors=[{
            "code": "file_too_large", "line": None, "param": "input_file_id",
            "message": f"the input file is larger than {config.max_file_bytes} bytes"}])
    with store.write() as conn:
        conn.execute(insert(batches).values(**values))
        watch(conn, "batch", str(values["id"]), tenant_id, now)
    return get_batch(store, tenant_id, str(values["id"]))


@retry_conflicts
def cancel_batch(store: Store, tenant_id: str, batch_id: str,
                 now: float | None = None) -> BatchRecord:
    """Cancel the unfinished lines (their leases are revoked); finished results are kept."""
    now = time.time() if now is None else now
    with store.write() as conn:
        status = conn.execute(select(batches.c.status).where(
            batches.c.id == batch_id, batches.c.tenant_id == tenant_id)).scalar()
        if status is None:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id")
        if status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            conn.execute(update(batches).where(batches.c.id == batch_id,
                                               batches.c.status == status)
                         .values(status=BatchStatus.CANCELLING.value, cancelling_at=now,
                                 end_status=BatchStatus.CANCELLED.value))
            conn.execute(
                update(requests)
                .where(requests.c.batch_id == batch_id,
                       requests.c.status.in_([s.value for s in ACTIVE_REQUEST_STATUSES]))
                .values(status=RequestStatus.CANCELLED.value, finished_at=now,
                        lease_expires_at=None, version=requests.c.version + 1, progress=None,
                        error={"code": "batch_cancelled", "source": "batch",
                               "message": "the batch was cancelled before this request ran"}))
            checkpoints.drop_for_batches(conn, [batch_id])
        elif status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            raise ConflictError(f"Cannot cancel a batch with status {status}.",
                                param="batch_id")
    return get_batch(store, tenant_id, batch_id)


def recent_batches(store: Store, limit: int = 20) -> list[BatchRecord]:
    """The newest batches of every tenant, with progress: for operators (the dashboard)."""
    with store.read() as conn:
        rows = conn.execute(select(batches).order_by(batches.c.created_at.desc(),
                                                     batches.c.id.desc()).limit(limit)).all()
        totals = _counts(conn, [r.id for r in rows])
    return [_record(r, *totals[r.id]) for r in rows]
