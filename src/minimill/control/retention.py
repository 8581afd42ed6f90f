"""No tenant text kept forever: request rows lose their prompts and results with what they
belong to, in bounded transactions, safe for any number of processes.

- A batch's rows keep its lines (prompts, results, custom_ids, errors) only while the batch
  needs them: when one of an ended batch's files goes (deleted by its tenant, or expired:
  files.py calls `clear_batches_of`), the rows keep only their counts and usage, which the
  batch's totals are summed from.
- A realtime request or response is deleted `request_retention_s` after it ended (30 days by
  default, as OpenAI keeps responses; a janitor step): its retries' Idempotency-Key and a
  response's `previous_response_id` reach back that far, not further. A response its tenant
  deletes is gone at once (responses.delete_response).
"""

from __future__ import annotations

from sqlalchemy import delete, null, or_, select, update

from minimill.control import checkpoints
from minimill.control.records import TERMINAL_REQUEST_STATUSES, BatchStatus
from minimill.control.store import Store, retry_conflicts
from minimill.control.tables import batches, requests

# Rows cleared or deleted per transaction.
ROWS_PER_TX = 1000
_ENDED = [s.value for s in (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED,
                            BatchStatus.CANCELLED)]
_FINISHED = [s.value for s in TERMINAL_REQUEST_STATUSES]


@retry_conflicts
def _clear_rows(store: Store, batch_id: str, after_seq: int) -> list[int]:
    """Clear the text of the batch's next group of rows after `after_seq`; their seqs."""
    with store.write() as conn:
        seqs = list(conn.execute(select(requests.c.seq).where(
            requests.c.batch_id == batch_id, requests.c.seq > after_seq)
            .order_by(requests.c.seq).limit(ROWS_PER_TX)).scalars().all())
        if seqs:
            # SQL NULL, not JSON null: nothing of the text is left.
            conn.execute(update(requests).where(requests.c.seq.in_(seqs))
                         .values(body=null(), result=null(), error=null(), custom_id=None))
    return seqs


def clear_batches_of(store: Store, file_id: str, now: float) -> int:
    """The file `file_id` is going: clear the rows of the ended batches it belongs to (as input,
    output or error file); returns the rows cleared."""
    with store.read() as conn:
        ids = conn.execute(select(batches.c.id).where(
            batches.c.status.in_(_ENDED), batches.c.rows_purged_at.is_(None),
            or_(batches.c.input_file_id == file_id, batches.c.output_file_id == file_id,
                batches.c.error_file_id == file_id))).scalars().all()
    cleared = 0
    for batch_id in ids:
        after = -1
        while seqs := _clear_rows(store, batch_id, after):
            cleared += len(seqs)
            after = seqs[-1]
        with store.write() as conn:
            conn.execute(update(batches).where(batches.c.id == batch_id)
                         .values(rows_purged_at=now))
    return cleared


@retry_conflicts
def delete_old_requests(store: Store, now: float, retention_s: float | None) -> int:
    """Delete one group of realtime requests and responses that ended more than
    `retention_s` ago (None: kept); returns how many."""
    if retention_s is None:
        return 0
    with store.write() as conn:
        # ix_requests_batch_finished: a range of the index, whatever the table's size.
        ids = conn.execute(select(requests.c.id).where(
            requests.c.batch_id.is_(None), requests.c.finished_at < now - retention_s,
            requests.c.status.in_(_FINISHED)).limit(ROWS_PER_TX)).scalars().all()
        if ids:
            checkpoints.drop(conn, list(ids))
            conn.execute(delete(requests).where(requests.c.id.in_(ids)))
    return len(ids)
