"""Files (batch inputs, outputs and error files): metadata rows plus content in chunks."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from sqlalchemy import Connection, and_, delete, func, insert, or_, select

from minimill.control.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError
from minimill.control.records import FileRecord, new_id
from minimill.control.store import Store
from minimill.control.tables import file_chunks, files

CHUNK_BYTES = 4 * 1024 * 1024
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"


def _record(row: Any) -> FileRecord:
    return FileRecord(id=row.id, tenant_id=row.tenant_id, purpose=row.purpose,
                      filename=row.filename, bytes=row.bytes, created_at=row.created_at)


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
    """Store content under `blob_id` in chunks (files, box snapshots); returns its size."""
    size = 0
    for seq, chunk in enumerate(_rechunk(parts, max_bytes)):
        conn.execute(insert(file_chunks).values(file_id=blob_id, seq=seq, data=chunk))
        size += len(chunk)
    return size


def iter_chunks(store: Store, blob_id: str) -> Iterator[bytes]:
    """Content stored under `blob_id`, one chunk per query (a large one is never read whole)."""
    seq = 0
    while True:
        with store.read() as conn:
            data = conn.execute(select(file_chunks.c.data).where(
                file_chunks.c.file_id == blob_id, file_chunks.c.seq == seq)).scalar()
        if data is None:
            return
        yield bytes(data)
        seq += 1


def insert_file(conn: Connection, tenant_id: str, purpose: str, filename: str,
                parts: Iterable[bytes], max_bytes: int | None = None) -> FileRecord:
    """Store a file inside the caller's transaction (batch finalization uses this)."""
    file_id = new_id("file-")
    size = insert_chunks(conn, file_id, parts, max_bytes)
    record = FileRecord(id=file_id, tenant_id=tenant_id, purpose=purpose, filename=filename,
                        bytes=size, created_at=time.time())
    conn.execute(insert(files).values(id=record.id, tenant_id=tenant_id, purpose=purpose,
                                      filename=filename, bytes=size,
                                      created_at=record.created_at))
    return record


def create_file(store: Store, tenant_id: str, purpose: str, filename: str,
                parts: Iterable[bytes], max_bytes: int | None = None) -> FileRecord:
    """Upload: `parts` is the content in pieces of any size; over `max_bytes` raises 413."""
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequestError(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}; got "
                                  f"{purpose!r}", param="purpose")
    if not filename or len(filename) > 500 or "\x00" in filename:
        raise InvalidRequestError("filename must have 1 to 500 characters, none of them NUL",
                                  param="file")
    with store.write() as conn:
        return insert_file(conn, tenant_id, purpose, filename, parts, max_bytes)


def get_file(store: Store, tenant_id: str, file_id: str) -> FileRecord:
    with store.read() as conn:
        row = conn.execute(select(files).where(files.c.id == file_id,
                                               files.c.tenant_id == tenant_id)).first()
    if row is None:
        raise NotFoundError(f"No such File object: {file_id}", param="file_id")
    return _record(row)


def list_files(store: Store, tenant_id: str, *, purpose: str | None = None,
               after: str | None = None, limit: int = 10000,
               order: Literal["asc", "desc"] = "desc") -> tuple[list[FileRecord], bool]:
    """A page of the tenant's files and whether more follow; `after` is a file id cursor."""
    query = select(files).where(files.c.tenant_id == tenant_id)
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


def iter_content(store: Store, tenant_id: str, file_id: str) -> tuple[FileRecord,
                                                                      Iterator[bytes]]:
    """The file's record and an iterator over its content, one chunk per query."""
    record = get_file(store, tenant_id, file_id)
    with store.read() as conn:
        count = conn.execute(select(func.count()).select_from(file_chunks)
                             .where(file_chunks.c.file_id == file_id)).scalar_one()

    def chunks() -> Iterator[bytes]:
        for seq in range(count):
            with store.read() as conn:
                data = conn.execute(select(file_chunks.c.data).where(
                    file_chunks.c.file_id == file_id, file_chunks.c.seq == seq)).scalar()
            if data is None:  # deleted while being read
                return
            yield bytes(data)

    return record, chunks()


def read_content(store: Store, tenant_id: str, file_id: str) -> bytes:
    """The whole content at once (batch ingest)."""
    _, chunks = iter_content(store, tenant_id, file_id)
    return b"".join(chunks)


def delete_file(store: Store, tenant_id: str, file_id: str) -> None:
    with store.write() as conn:
        gone = conn.execute(delete(files).where(files.c.id == file_id,
                                                files.c.tenant_id == tenant_id)).rowcount
        if not gone:
            raise NotFoundError(f"No such File object: {file_id}", param="file_id")
        conn.execute(delete(file_chunks).where(file_chunks.c.file_id == file_id))
