"""Loading a batch's input file into request rows, in bounded memory and short transactions.

`create_batch` leaves a batch `validating`. An ingester (any control-plane process: the API runs
`ingest_pending` in a worker thread) claims it, reads the file once to decide whether it is
usable at all (batch_ingest.scan), then reads it again from the batch's cursor, inserting a group
of rows per transaction together with the cursor they advance it to (byte offset, line number).
That cursor update is conditional on the claim and on the cursor the group started from, so a
group is inserted once or not at all; a unique (batch_id, line_no) index says the same to the
database. A dead ingester's claim goes stale after `ingest_claim_ttl_s` and another resumes at
the cursor, reloading the custom_ids seen so far from the rows. Progress shows as the batch's
growing request count; the last group turns the batch `in_progress`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, or_, select, update
from sqlalchemy.exc import SQLAlchemyError

from minimill.control.batch_ingest import (
    LineParser,
    ParsedLine,
    UnusableFileError,
    custom_id_key,
    scan,
    split_lines,
)
from minimill.control.config import ControlConfig
from minimill.control.files import PROCESSED, chunks_from
from minimill.control.records import BatchStatus, RequestStatus, Tier, new_id
from minimill.control.requests import new_seed, row_values
from minimill.control.store import JsonText, Store, insert_many
from minimill.control.tables import batches, files, requests

# A group also ends once its lines hold this many bytes, whatever `ingest_group_lines` says.
GROUP_BYTES = 1024 * 1024
# Lines parsed between two chances for other threads (the event loop) to take the GIL.
YIELD_EVERY_LINES = 64
_VALIDATING = BatchStatus.VALIDATING.value
log = logging.getLogger("minimill.batches")


class _LostClaim(Exception):
    """The batch was cancelled, or another ingester took it over: stop without writing."""


@dataclass(frozen=True, slots=True)
class _Claim:
    batch_id: str
    token: str
    tenant_id: str
    input_file_id: str
    endpoint: str
    deadline: float  # the batch's expires_at: every row's deadline
    offset: int
    line_no: int


def ingest_pending(store: Store, now: float, config: ControlConfig) -> int:
    """Ingest the batches waiting for it that no live ingester holds; returns how many were
    finished (queued, failed, or left to a cancel)."""
    done = 0
    while (claim := _claim(store, now, config)) is not None:
        try:
            _ingest(store, claim, config)
        except _LostClaim:
            pass
        except SQLAlchemyError:
            raise  # the store is unreachable: the claim goes stale and the ingest resumes
        except Exception as exc:
            # A batch that breaks the ingester (its lines are a tenant's) fails alone; it must
            # not abort the round of every batch behind it, again at each retry.
            log.exception("batch %s: ingest failed", claim.batch_id)
            try:
                _fail(store, claim, [{"code": "ingest_error", "line": None, "param": None,
                                      "message": f"the input file could not be read "
                                                 f"({type(exc).__name__})"}])
            except _LostClaim:
                pass
        done += 1
        now = time.time()
    return done


def _claim(store: Store, now: float, config: ControlConfig) -> _Claim | None:
    free = or_(batches.c.ingest_claimed_at.is_(None),
               batches.c.ingest_claimed_at < now - config.ingest_claim_ttl_s)
    with store.write() as conn:
        row = conn.execute(select(batches).where(batches.c.status == _VALIDATING, free)
                           .order_by(batches.c.created_at).limit(1)
                           .with_for_update(skip_locked=True)).first()
        if row is None:
            return None
        token = new_id("ing_")
        taken = conn.execute(update(batches)
                             .where(batches.c.id == row.id, batches.c.status == _VALIDATING,
                                    free)
                             .values(ingest_claim=token, ingest_claimed_at=now)).rowcount
    if not taken:
        return None
    return _Claim(batch_id=row.id, token=token, tenant_id=row.tenant_id,
                  input_file_id=row.input_file_id, endpoint=row.endpoint,
                  deadline=row.expires_at, offset=int(row.ingest_offset),
                  line_no=int(row.ingest_line))


def _input_size(store: Store, claim: _Claim) -> int | None:
    with store.read() as conn:
        size = conn.execute(select(files.c.bytes).where(
            files.c.id == claim.input_file_id, files.c.tenant_id == claim.tenant_id,
            files.c.status == PROCESSED)).scalar()
    return None if size is None else int(size)


def _counted(chunks: Iterator[bytes], seen: list[int]) -> Iterator[bytes]:
    """The chunks, adding their sizes to seen[0] (a file deleted meanwhile ends early)."""
    for chunk in chunks:
        seen[0] += len(chunk)
        yield chunk


def _ingest(store: Store, claim: _Claim, config: ControlConfig) -> None:
    size = _input_size(store, claim)
    if size is None:
        _fail(store, claim, [_vanished(claim)])
        return
    if claim.offset == 0:
        read = [0]
        try:
            scan(_counted(chunks_from(store, claim.input_file_id), read),
                 config.max_batch_lines, config.max_line_bytes)
        except UnusableFileError as exc:
            _fail(store, claim, [e.as_dict() for e in exc.errors])
            return
        if read[0] != size:
            _fail(store, claim, [_vanished(claim)])
            return
    parser = LineParser(claim.endpoint, config.served_models, _seen(store, claim.batch_id))
    group: list[ParsedLine] = []
    group_bytes, cursor, end = 0, (claim.offset, claim.line_no), (claim.offset, claim.line_no)
    lines = split_lines(chunks_from(store, claim.input_file_id, claim.offset),
                        config.max_line_bytes, claim.offset, claim.line_no)
    for count, line in enumerate(lines, 1):
        parsed = parser.parse(line, config.max_line_bytes)
        if parsed is not None:
            group.append(parsed)
            group_bytes += len(line.data or b"")
        end = (line.end, line.line_no)
        if len(group) >= config.ingest_group_lines or group_bytes >= GROUP_BYTES:
            _commit(store, claim, cursor, end, group, last=False)
            group, group_bytes, cursor = [], 0, end
        if count % YIELD_EVERY_LINES == 0:
            time.sleep(0)  # let the event loop thread run (heartbeats wait on it)
    if end[0] != size:
        _fail(store, claim, [_vanished(claim)])
        return
    _commit(store, claim, cursor, end, group, last=True)


def _seen(store: Store, batch_id: str) -> set[bytes]:
    """The custom_ids of the lines already ingested (a resumed ingest checks against them)."""
    with store.read() as conn:
        return {custom_id_key(c) for c in conn.execute(
            select(requests.c.custom_id).where(requests.c.batch_id == batch_id,
                                               requests.c.custom_id.is_not(None))).scalars()}


def _rows(claim: _Claim, group: list[ParsedLine],
          now: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Queued rows of good lines, and failed rows of bad ones (two bulk inserts: one
    executemany needs one set of columns)."""
    good: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    for line in group:
        extra: dict[str, Any] = {"batch_id": claim.batch_id, "custom_id": line.custom_id,
                                 "line_no": line.line_no}
        if line.prepared is not None:
            # Its prompt is counted once it is queued (prompt_count.count_uncounted); its body
            # was encoded when it was parsed.
            if line.body_json is not None:
                extra["body"] = JsonText(line.body_json)
            good.append(row_values(claim.tenant_id, line.prepared, now, claim.deadline,
                                   Tier.BACKGROUND, count_later=True, **extra))
            continue
        error = {**line.error.as_dict(), "source": "validation"} if line.error else None
        bad.append({"id": new_id("req_"), "tenant_id": claim.tenant_id, "kind": None,
                    "tier": Tier.BACKGROUND.value, "model": None, "body": None,
                    "seed": new_seed(), "max_tokens": None, "stream": False,
                    "status": RequestStatus.FAILED.value, "epoch": 0, "attempts": 0,
                    "version": 0, "prompt_tokens": 0, "completion_tokens": 0, "billed_usd": 0.0,
                    "created_at": now, "finished_at": now, "deadline": claim.deadline,
                    "error": error, **extra})
    return good, bad


def _commit(store: Store, claim: _Claim, cursor: tuple[int, int], end: tuple[int, int],
            group: list[ParsedLine], last: bool) -> None:
    """Insert one group and advance the cursor from `cursor` to `end`, in one transaction;
    the last one also starts the batch."""
    now = time.time()
    good, bad = _rows(claim, group, now)
    values: dict[str, Any] = {"ingest_offset": end[0], "ingest_line": end[1],
                              "ingest_claimed_at": now}
    if last:
        values.update(status=BatchStatus.IN_PROGRESS.value, in_progress_at=now,
                      ingest_claim=None)
    with store.write() as conn:
        # The batch row first: it is the lock a cancel takes too, so rows are either in
        # before the cancel (and cancelled by it) or never written.
        moved = conn.execute(update(batches)
                             .where(batches.c.id == claim.batch_id,
                                    batches.c.status == _VALIDATING,
                                    batches.c.ingest_claim == claim.token,
                                    batches.c.ingest_offset == cursor[0])
                             .values(**values)).rowcount
        if not moved:
            raise _LostClaim(claim.batch_id)
        insert_many(conn, requests, good)
        insert_many(conn, requests, bad)


def _vanished(claim: _Claim) -> dict[str, Any]:
    return {"code": "file_not_found", "line": None, "param": "input_file_id",
            "message": f"the input file {claim.input_file_id} was deleted before it was read"}


def _fail(store: Store, claim: _Claim, errors: list[dict[str, Any]]) -> None:
    """The file is unusable: the batch fails, without any of its lines."""
    with store.write() as conn:
        failed = conn.execute(update(batches)
                              .where(batches.c.id == claim.batch_id,
                                     batches.c.status == _VALIDATING,
                                     batches.c.ingest_claim == claim.token)
                              .values(status=BatchStatus.FAILED.value, failed_at=time.time(),
                                      errors=errors, ingest_claim=None)).rowcount
        if not failed:
            raise _LostClaim(claim.batch_id)
        # Lines queued before the file vanished must not run for a failed batch.
        conn.execute(delete(requests).where(requests.c.batch_id == claim.batch_id))
