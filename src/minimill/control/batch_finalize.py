"""Ending batches: expiry of the completion window, and finalization into output/error files.

Finalization is claimed with a conditional UPDATE (and re-claimable after `finalize_claim_ttl_s`
if its janitor died), and the files plus the final status are written in one transaction that
checks the claim, so with several control-plane processes a batch still gets exactly one pair
of files. Output lines are in input order; every line of the input appears exactly once across
the output file (successes) and the error file (everything else).
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection, case, exists, func, select, update

from minimill.control.files import OUTPUT_PURPOSE, insert_file
from minimill.control.records import (
    ACTIVE_REQUEST_STATUSES,
    BatchStatus,
    Kind,
    RequestStatus,
)
from minimill.control.render import (
    batch_error_line,
    batch_output_line,
    render_response,
    usage_dict,
)
from minimill.control.requests import record
from minimill.control.response_render import render_response as render_response_object
from minimill.control.store import Store, retry_conflicts
from minimill.control.tables import batches, requests

_ACTIVE = [s.value for s in ACTIVE_REQUEST_STATUSES]
_ENDABLE = [BatchStatus.IN_PROGRESS.value, BatchStatus.CANCELLING.value,
            BatchStatus.FINALIZING.value]
_END_COLUMN = {BatchStatus.COMPLETED.value: "completed_at", BatchStatus.EXPIRED.value:
               "expired_at", BatchStatus.CANCELLED.value: "cancelled_at"}


class _LostClaim(Exception):
    """Another janitor finished this batch first; the transaction is rolled back."""


def _no_active_rows() -> Any:
    return ~exists().where(requests.c.batch_id == batches.c.id,
                           requests.c.status.in_(_ACTIVE))


@retry_conflicts
def expire_due(store: Store, now: float) -> int:
    """Batches past their window: unfinished lines expire; the batch then finalizes."""
    with store.write() as conn:
        due = conn.execute(
            update(batches)
            .where(batches.c.status == BatchStatus.IN_PROGRESS.value,
                   batches.c.expires_at < now, batches.c.end_status.is_(None))
            .values(end_status=BatchStatus.EXPIRED.value)
            .returning(batches.c.id)).scalars().all()
        if due:
            conn.execute(
                update(requests)
                .where(requests.c.batch_id.in_(due), requests.c.status.in_(_ACTIVE))
                .values(status=RequestStatus.EXPIRED.value, finished_at=now,
                        lease_expires_at=None, version=requests.c.version + 1,
                        error={"code": "batch_expired", "source": "batch",
                               "message": "the batch's completion window ended before this "
                                          "request ran"}))
    return len(due)


def finishable(store: Store, now: float, claim_ttl_s: float) -> list[str]:
    """Batches whose rows are all terminal and that no live janitor is finalizing."""
    query = select(batches.c.id).where(
        batches.c.status.in_(_ENDABLE), _no_active_rows(),
        (batches.c.finalize_claimed_at.is_(None))
        | (batches.c.finalize_claimed_at < now - claim_ttl_s))
    with store.read() as conn:
        return list(conn.execute(query).scalars().all())


def _lines(conn: Connection, batch_id: str) -> tuple[list[bytes], list[bytes]]:
    output: list[bytes] = []
    errors: list[bytes] = []
    query = (select(requests).where(requests.c.batch_id == batch_id)
             .order_by(requests.c.line_no))
    for r in conn.execute(query):
        if r.status == RequestStatus.SUCCEEDED and r.kind == Kind.RESPONSE:
            body = render_response_object(record(r))
            output.append(json.dumps(batch_output_line(r.id, r.custom_id, body)).encode())
        elif r.status == RequestStatus.SUCCEEDED:
            body = render_response(Kind(r.kind), r.id, r.model, r.created_at, r.tier,
                                   (r.result or {}).get("choices", []),
                                   usage_dict(r.prompt_tokens, r.completion_tokens, r.billed_usd,
                                              r.cached_tokens or 0))
            output.append(json.dumps(batch_output_line(r.id, r.custom_id, body)).encode())
        else:
            error = r.error or {"code": r.status, "message": f"request {r.status}"}
            errors.append(json.dumps(batch_error_line(r.id, r.custom_id, error)).encode())
    return output, errors


def finalize(store: Store, batch_id: str, now: float, claim_ttl_s: float) -> bool:
    """Write the batch's output and error files and set its final status; False if another
    janitor has it or it is not ready."""
    cancelling = batches.c.status == BatchStatus.CANCELLING.value
    with store.write() as conn:
        claimed = conn.execute(
            update(batches)
            .where(batches.c.id == batch_id, batches.c.status.in_(_ENDABLE), _no_active_rows(),
                   (batches.c.finalize_claimed_at.is_(None))
                   | (batches.c.finalize_claimed_at < now - claim_ttl_s))
            .values(status=case((cancelling, BatchStatus.CANCELLING.value),
                                else_=BatchStatus.FINALIZING.value),
                    finalizing_at=case((cancelling, None),
                                       else_=func.coalesce(batches.c.finalizing_at, now)),
                    end_status=func.coalesce(batches.c.end_status,
                                             BatchStatus.COMPLETED.value),
                    finalize_claimed_at=now)
            .returning(batches.c.tenant_id, batches.c.end_status)).first()
    if claimed is None:
        return False
    with store.read() as conn:
        output, errors = _lines(conn, batch_id)
    try:
        with store.write() as conn:
            values: dict[str, Any] = {"status": claimed.end_status,
                                      _END_COLUMN[claimed.end_status]: now}
            for name, lines, column in ((f"{batch_id}_output.jsonl", output, "output_file_id"),
                                        (f"{batch_id}_error.jsonl", errors, "error_file_id")):
                if lines:
                    record = insert_file(conn, claimed.tenant_id, OUTPUT_PURPOSE, name,
                                         (line + b"\n" for line in lines))
                    values[column] = record.id
            done = conn.execute(
                update(batches)
                .where(batches.c.id == batch_id, batches.c.finalize_claimed_at == now,
                       batches.c.status.in_([BatchStatus.FINALIZING.value,
                                             BatchStatus.CANCELLING.value]))
                .values(**values)).rowcount
            if not done:
                raise _LostClaim(batch_id)
    except _LostClaim:
        return False
    return True
