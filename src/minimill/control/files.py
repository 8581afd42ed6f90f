"""Files (batch inputs, outputs and error files): metadata rows plus content in chunks.

A file is written chunk by chunk, each chunk in its own short transaction, while its row says
`writing` (clients do not see it); sealing it makes it `processed`. Deleting marks the row
`deleting` and then removes its chunks a few at a time. Neither holds the store's write lock for
long, and a writer or deleter that dies leaves a row the janitor finishes off (`sweep`), along
with files past their `expires_at` (OpenAI's `expires_after`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from sqlalchemy import Connection, and_, delete, insert, or_, select, update

from minimill.control import quotas
from minimill.control.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError
from minimill.control.records import FileRecord, new_id
from minimill.control.retention import clear_batches_of
from minimill.control.store import Store
from minimill.control.tables import file_chunks, files
from minimill.control.tenant_limits import TenantLimits

CHUNK_BYTES = 4 * 1024 * 1024
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"
WRITING, PROCESSED, DELETING = "writing", "processed", "deleting"
# OpenAI's bounds on `expires_after.seconds`.
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 24 * 3600
# Chunks deleted per transaction.
DELETE_CHUNKS_PER_TX = 8


def _record(row: Any) -> FileRecord:
    return FileRecord(id=row.id, tenant_id=row.tenant_id, purpose=row.purpose,
                      filename=row.filename, bytes=row.bytes, created_at=row.created_at,
                      expires_at=row.expires_at)


def check_expires_after(anchor: str | None, seconds: int | None) -> int | None:
    """Validate OpenAI's `expires_after` ({"anchor": "created_at", "seconds": N})."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidRequestError("expires_after.anchor must be 'created_at'",
                                  param="expires_after.anchor")
    if seconds is None or not MIN_EXPIRES_AFTER_S <= seconds <= MAX_EXPIRES_AFTER_S:
        raise InvalidRequestError(f"expires_after.seconds must be between {MIN_EXPIRES_AFTER_S} "
                                  f"and {MAX_EXPIRES_AFTER_S}", param="expires_after.seconds")
    return seconds


def _visible(now: float) -> Any:
    return and_(files.c.status == PROCESSED,
                or_(files.c.expires_at.is_(None), files.c.expires_at > now))


class FileWriter:
    """A file written chunk by chunk, each chunk in its own transaction; `seal` publishes it,
    `discard` removes it. Every chunk but the last holds exactly CHUNK_BYTES."""

    def __init__(self, store: Store, tenant_id: str, purpose: str, filename: str,
                 expires_after_s: float | None, max_bytes: int | None = None) -> None:
        self.store, self.max_bytes = store, max_bytes
        self.id = new_id("file-")
        self.created_at = time.time()
        self.size = 0
        self._seq = 0
        self._buf = bytearray()
        self.record = FileRecord(id=self.id, tenant_id=tenant_id, purpose=purpose,
                                 filename=filename, bytes=0, created_at=self.created_at,
                                 expires_at=(self.created_at + expires_after_s
                                             if expires_after_s else None))
        with store.write() as conn:
            conn.execute(insert(files).values(
                id=self.id, tenant_id=tenant_id, purpose=purpose, filename=filename, bytes=0,
                created_at=self.created_at, status=WRITING, expires_at=self.record.expires_at))

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.max_bytes is not None and self.size > self.max_bytes:
            raise PayloadTooLargeError(f"file is larger than the limit of {self.max_bytes} "
                                       "bytes", param="file", code="file_too_large")
        self._buf += data
        while len(self._buf) >= CHUNK_BYTES:
            self._flush(bytes(self._buf[:CHUNK_BYTES]))
            del self._buf[:CHUNK_BYTES]

    def _flush(self, chunk: bytes) -> None:
        with self.store.write() as conn:
            conn.execute(insert(file_chunks).values(file_id=self.id, seq=self._seq, data=chunk))
        self._seq += 1

    def close(self) -> None:
        """Write what is buffered (the last chunk); `seal` follows, maybe in a caller's
        transaction."""
        if self._buf:
            self._flush(bytes(self._buf))
            self._buf.clear()

    def seal(self, conn: Connection) -> FileRecord:
        """Publish the file inside the caller's transaction (after `close`)."""
        done = conn.execute(update(files).where(files.c.id == self.id, files.c.status == WRITING)
                            .values(status=PROCESSED, bytes=self.size)).rowcount
        if not done:  # the janitor took it for a dead writer's
            raise NotFoundError(f"file {self.id} was removed while being written")
        return FileRecord(id=self.id, tenant_id=self.record.tenant_id,
                          purpose=self.record.purpose, filename=self.record.filename,
                          bytes=self.size, created_at=self.created_at,
                          expires_at=self.record.expires_at)

    def discard(self) -> None:
        with self.store.write() as conn:
            conn.execute(update(files).where(files.c.id == self.id).values(status=DELETING))
        _remove(self.store, self.id)


def _rechunk(parts: Iterable[bytes], max_bytes: int | None) -> Iterator[bytes]:
    """Fixed-size chunks of the concatenated parts; raises once the total exceeds max_bytes."""
    buf, total = bytearray(), 0
    for part in parts:
        total += len(part)
        if max_bytes is not None and total > max_bytes:
            raise PayloadTooLargeError(f"file is larger than the limit of {max_bytes} bytes",
                                       param="file", code="file_too_large")
        buf += part
        while len(buf) >= CHUNK_BYTES:
            yield bytes(buf[:CHUNK_BYTES])
            del buf[:CHUNK_BYTES]
    if buf:
        yield bytes(buf)


def insert_chunks(conn: Connection, blob_id: str, parts: Iterable[bytes],
                  max_bytes: int | None = None) -> int:
    """Store content under `blob_id` in chunks inside the caller's transaction (box
    snapshots); returns its size."""
    size = 0
    for seq, chunk in enumerate(_rechunk(parts, max_bytes)):
        conn.execute(insert(file_chunks).values(file_id=blob_id, seq=seq, data=chunk))
        size += len(chunk)
    return size


def iter_chunks(store: Store, blob_id: str) -> Iterator[bytes]:
    """Content stored under `blob_id`, one chunk per query (a large one is never read whole)."""
    return chunks_from(store, blob_id)


def create_file(store: Store, tenant_id: str, purpose: str, filename: str,
                parts: Iterable[bytes], max_bytes: int | None = None,
                expires_after_s: float | None = None,
                limits: TenantLimits | None = None) -> FileRecord:
    """Upload: `parts` is the content in pieces of any size; over `max_bytes` raises 413,
    over the tenant's stored-bytes quota (`limits`) 429 insufficient_quota."""
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequestError(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}; got "
                                  f"{purpose!r}", param="purpose")
    if not filename or len(filename) > 500 or "\x00" in filename:
        raise InvalidRequestError("filename must have 1 to 500 characters, none of them NUL",
                                  param="file")
    if limits is not None and limits.max_stored_bytes is not None:
        with store.read() as conn:  # already full: refused before anything is read
            quotas.check_stored_bytes(conn, tenant_id, 1, limits)
    writer = FileWriter(store, tenant_id, purpose, filename, expires_after_s, max_bytes)
    try:
        for part in parts:
            writer.write(part)
        writer.close()
        with store.write() as conn:
            quotas.check_stored_bytes(conn, tenant_id, writer.size, limits, writer.id)
            return writer.seal(conn)
    except BaseException:
        writer.discard()
        raise


def get_file(store: Store, tenant_id: str, file_id: str,
             now: float | None = None) -> FileRecord:
    now = time.time() if now is None else now
    with store.read() as conn:
        row = conn.execute(select(files).where(files.c.id == file_id,
                                               files.c.tenant_id == tenant_id,
                                               _visible(now))).first()
    if row is None:
        raise NotFoundError(f"No such File object: {file_id}", param="file_id")
    return _record(row)


def list_files(store: Store, tenant_id: str, *, purpose: str | None = None,
               after: str | None = None, limit: int = 10000,
               order: Literal["asc", "desc"] = "desc") -> tuple[list[FileRecord], bool]:
    """A page of the tenant's files and whether more follow; `after` is a file id cursor."""
    query = select(files).where(files.c.tenant_id == tenant_id, _visible(time.time()))
    if purpose:
        query = query.where(files.c.purpose == purpose)
    with store.read() as conn:
        if after:
            cursor = conn.execute(select(files.c.created_at).where(
                files.c.id == after, files.c.tenant_id == tenant_id)).first()
            if cursor is None:
                raise NotFoundError(f"No such File object: {after}", param="after")
            older = or_(files.c.created_at < cursor.created_at,
                        and_(files.c.created_at == cursor.created_at, files.c.id < after))
            newer = or_(files.c.created_at > cursor.created_at,
                        and_(files.c.created_at == cursor.created_at, files.c.id > after))
            query = query.where(older if order == "desc" else newer)
        keys = (files.c.created_at, files.c.id)
        query = query.order_by(*(k.desc() for k in keys) if order == "desc" else keys)
        rows = conn.execute(query.limit(limit + 1)).all()
    return [_record(r) for r in rows[:limit]], len(rows) > limit


def chunks_from(store: Store, file_id: str, offset: int = 0) -> Iterator[bytes]:
    """The file's content from byte `offset` on, one chunk (one short read) at a time; ends
    early if the file is deleted meanwhile."""
    seq, skip = divmod(offset, CHUNK_BYTES)
    while True:
        with store.read() as conn:
            data = conn.execute(select(file_chunks.c.data).where(
                file_chunks.c.file_id == file_id, file_chunks.c.seq == seq)).scalar()
        if data is None:
            return
        yield bytes(data[skip:]) if skip else bytes(data)
        seq, skip = seq + 1, 0


def iter_content(store: Store, tenant_id: str, file_id: str) -> tuple[FileRecord,
                                                                      Iterator[bytes]]:
    """The file's record and an iterator over its content, one chunk per query."""
    record = get_file(store, tenant_id, file_id)
    return record, chunks_from(store, file_id)


def read_content(store: Store, tenant_id: str, file_id: str) -> bytes:
    """The whole content at once (small files: tests, error reports)."""
    _, chunks = iter_content(store, tenant_id, file_id)
    return b"".join(chunks)


def delete_file(store: Store, tenant_id: str, file_id: str) -> None:
    with store.write() as conn:
        gone = conn.execute(update(files).where(files.c.id == file_id,
                                                files.c.tenant_id == tenant_id,
                                                _visible(time.time()))
                            .values(status=DELETING)).rowcount
    if not gone:
        raise NotFoundError(f"No such File object: {file_id}", param="file_id")
    _remove(store, file_id)


def _remove(store: Store, file_id: str) -> None:
    """Delete a `deleting` file's chunks a few per transaction, then its row; the rows of the
    ended batches it belongs to lose their text first (retention.py)."""
    clear_batches_of(store, file_id, time.time())
    while True:
        with store.write() as conn:
            seqs = conn.execute(select(file_chunks.c.seq).where(file_chunks.c.file_id == file_id)
                                .order_by(file_chunks.c.seq)
                                .limit(DELETE_CHUNKS_PER_TX)).scalars().all()
            if not seqs:
                conn.execute(delete(files).where(files.c.id == file_id))
                return
            conn.execute(delete(file_chunks).where(file_chunks.c.file_id == file_id,
                                                   file_chunks.c.seq.in_(seqs)))


def sweep(store: Store, now: float, writing_ttl_s: float, limit: int = 16) -> int:
    """Delete up to `limit` files that expired, whose deletion was interrupted, or whose
    writer died (still `writing` after `writing_ttl_s`); returns how many."""
    due = or_(and_(files.c.expires_at.is_not(None), files.c.expires_at <= now),
              files.c.status == DELETING,
              and_(files.c.status == WRITING, files.c.created_at < now - writing_ttl_s))
    with store.write() as conn:
        ids = conn.execute(select(files.c.id).where(due).limit(limit)).scalars().all()
        if ids:
            conn.execute(update(files).where(files.c.id.in_(ids)).values(status=DELETING))
    for file_id in ids:
        _remove(store, file_id)
    return len(ids)

