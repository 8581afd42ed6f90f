"""Ending batches: expiry of the completion window, and finalization into output/error files.

Finalization is claimed with a conditional UPDATE (and re-claimable after `finalize_claim_ttl_s`
if its janitor died). The rows are read a page at a time and the files written a chunk at a
time (files.FileWriter: short transactions, the files invisible meanwhile); one last transaction
that checks the claim publishes both files and sets the final status, so with several
control-plane processes a batch still gets exactly one pair of files, and a loser's files are
discarded. Output lines are in input order; every line of the input appears exactly once across
the output file (successes) and the error file (everything else).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from sqlalchemy import bindparam, case, exists, func, select, update

from minimill.control import checkpoints
from minimill.control.embeddings import render_embeddings
from minimill.control.files import OUTPUT_PURPOSE, FileWriter
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
# Rows read per query while writing the files.
PAGE_ROWS = 500
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
                        lease_expires_at=None, version=requests.c.version + 1, progress=None,
                        error={"code": "batch_expired", "source": "batch",
                               "message": "the batch's completion window ended before this "
                                          "request ran"}))
            checkpoints.drop_for_batches(conn, due)
    return len(due)


def finishable(store: Store, now: float, claim_ttl_s: float) -> list[str]:
    """Batches whose rows are all terminal and that no live janitor is finalizing."""
    query = select(batches.c.id).where(
        batches.c.status.in_(_ENDABLE), _no_active_rows(),
        (batches.c.finalize_claimed_at.is_(None))
        | (batches.c.finalize_claimed_at < now - claim_ttl_s))
    with store.read() as conn:
        return list(conn.execute(query).scalars().all())


# Built once: every call that completes requests asks it, and building it (a subquery, an
# EXISTS) took more of the call's CPU than running it.
_FINISHABLE = select(batches.c.id).where(
    batches.c.id.in_(select(requests.c.batch_id)
                     .where(requests.c.id.in_(bindparam("ids", expanding=True)),
                            requests.c.batch_id.is_not(None))),
    batches.c.status.in_(_ENDABLE), _no_active_rows()).limit(1)


def any_finishable_among(store: Store, request_ids: list[str]) -> bool:
    """Whether a batch of these (just completed) requests has no line left to run: the last
    completions of a batch wake its finalization rather than wait for the next poll."""
    if not request_ids:
        return False
    with store.read() as conn:
        return conn.execute(_FINISHABLE, {"ids": list(request_ids)}).first() is not None


# Every column but the body (the input line, up to max_line_bytes): only a response (its
# parameters) and embeddings (their encoding_format) need their body, read per page, for those
# rows alone.
_LINE_COLUMNS = [c for c in requests.c if c.name != "body"]


def _lines(store: Store, batch_id: str) -> Iterator[tuple[bool, bytes]]:
    """(is_output, line) for every row of the batch in input order, one page per query."""
    query = (select(*_LINE_COLUMNS).where(requests.c.batch_id == batch_id)
             .order_by(requests.c.line_no).limit(PAGE_ROWS))
    after: int | None = None
    while True:
        with store.read() as conn:
            page = conn.execute(query if after is None
                                else query.where(requests.c.line_no > after)).all()
            responses = [r.id for r in page if r.status == RequestStatus.SUCCEEDED
                         and r.kind in (Kind.RESPONSE, Kind.EMBEDDING)]
            bodies = dict(conn.execute(select(requests.c.id, requests.c.body)
                                       .where(requests.c.id.in_(responses))).tuples().all()
                          ) if responses else {}
        for r in page:
            if r.id in bodies and r.kind == Kind.EMBEDDING:
                body = render_embeddings(r.model or "", bodies[r.id],
                                         (r.result or {}).get("choices", []), r.prompt_tokens,
                                         r.billed_usd)
                yield True, json.dumps(batch_output_line(r.id, r.custom_id, body)).encode()
            elif r.id in bodies:
                body = render_response_object(replace(record(r), body=bodies[r.id]))
                yield True, json.dumps(batch_output_line(r.id, r.custom_id, body)).encode()
            elif r.status == RequestStatus.SUCCEEDED:
                body = render_response(Kind(r.kind), r.id, r.model, r.created_at, r.tier,
                                       (r.result or {}).get("choices", []),
                                       usage_dict(r.prompt_tokens, r.completion_tokens,
                                                  r.billed_usd, r.cached_tokens or 0))
                yield True, json.dumps(batch_output_line(r.id, r.custom_id, body)).encode()
            else:
                error = r.error or {"code": r.status, "message": f"request {r.status}"}
                yield False, json.dumps(batch_error_line(r.id, r.custom_id, error)).encode()
        if len(page) < PAGE_ROWS:
            return
        after = page[-1].line_no


def finalize(store: Store, batch_id: str, now: float, claim_ttl_s: float,
             expires_after_s: float | None = None) -> bool:
    """Write the batch's output and error files and set its final status; False if another
    janitor has it or it is not ready. The files expire after the batch's
    `output_expires_after`, else `expires_after_s` (None: kept)."""
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
            .returning(batches.c.tenant_id, batches.c.end_status,
                       batches.c.output_expires_after_s)).first()
    if claimed is None:
        return False
    ttl_s = claimed.output_expires_after_s or expires_after_s
    writers: dict[bool, FileWriter] = {}
    try:
        for is_output, line in _lines(store, batch_id):
            writer = writers.get(is_output)
            if writer is None:
                name = f"{batch_id}_{'output' if is_output else 'error'}.jsonl"
                writer = writers[is_output] = FileWriter(store, claimed.tenant_id,
                                                         OUTPUT_PURPOSE, name, ttl_s)
            writer.write(line + b"\n")
        for writer in writers.values():
            writer.close()
        with store.write() as conn:
            values: dict[str, Any] = {"status": claimed.end_status,
                                      _END_COLUMN[claimed.end_status]: now}
            for is_output, writer in writers.items():
                values["output_file_id" if is_output else "error_file_id"] = \
                    writer.seal(conn).id
            done = conn.execute(
                update(batches)
                .where(batches.c.id == batch_id, batches.c.finalize_claimed_at == now,
                       batches.c.status.in_([BatchStatus.FINALIZING.value,
                                             BatchStatus.CANCELLING.value]))
                .values(**values)).rowcount
            if not done:
                raise _LostClaim(batch_id)
    except BaseException as exc:
        for writer in writers.values():
            writer.discard()
        if isinstance(exc, _LostClaim):
            return False
        raise
    return True
