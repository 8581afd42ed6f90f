"""Snapshots a box host stores (box_protocol.py): whole in one body (older hosts), or in parts
(`store_snapshot_part`, then `commit_snapshot`), so that a snapshot is bounded by the control
plane's file limit, never by one body's. Parts are file_chunks under the upload's id, which
becomes the snapshot's; `box_snapshot_uploads` records an upload until it is committed, and
one never committed goes after UPLOAD_TTL_S (`drop_stale_uploads`, from the janitor's
reaping). Everything is accepted only from the box's host at its current epoch. A snapshot past
the file limit is a 413, which the host takes as a refusal for good.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, update

from minimill.control.box_records import BoxStatus, SnapshotKind
from minimill.control.boxes import drop_unneeded, store_archive
from minimill.control.errors import ConflictError, InvalidRequestError, PayloadTooLargeError
from minimill.control.records import Site
from minimill.control.store import Store, retry_conflicts
from minimill.control.tables import box_snapshot_uploads, box_snapshots, boxes, file_chunks
from minimill.transport.box_protocol import SNAPSHOT_PARENT_NOT_FOUND, SnapshotStored

_RUNNING = BoxStatus.RUNNING.value
# A snapshot upload not committed this long after its first part lost its host: dropped.
UPLOAD_TTL_S = 3600.0


def _held_for_snapshot(conn: Connection, site: Site, box_id: str, epoch: int) -> Any:
    row = conn.execute(select(boxes.c.tenant_id, boxes.c.snapshot_id).where(
        boxes.c.id == box_id, boxes.c.epoch == epoch, boxes.c.site_id == site.id,
        boxes.c.status == _RUNNING).with_for_update()).first()
    if row is None:
        raise ConflictError(f"box {box_id} is not this host's at epoch {epoch}",
                            code="stale_epoch")
    return row


def _record_snapshot(conn: Connection, box_id: str, tenant_id: str, kind: SnapshotKind,
                     parts: Iterable[bytes], max_bytes: int, parent_id: str | None,
                     snapshot_id: str | None = None) -> SnapshotStored:
    """The archive becomes the box's latest snapshot; automatic ones it replaces go."""
    if parent_id is not None and conn.execute(select(box_snapshots.c.id).where(
            box_snapshots.c.id == parent_id,
            box_snapshots.c.box_id == box_id)).first() is None:
        raise ConflictError(f"snapshot {parent_id}, the parent of this incremental "
                            f"snapshot, is not one of box {box_id}",
                            code=SNAPSHOT_PARENT_NOT_FOUND)
    record = store_archive(conn, tenant_id, box_id, kind, parts, max_bytes, parent_id,
                           snapshot_id=snapshot_id)
    conn.execute(update(boxes).where(boxes.c.id == box_id).values(snapshot_id=record.id))
    previous = conn.execute(select(box_snapshots.c.id).where(
        box_snapshots.c.box_id == box_id, box_snapshots.c.kind == SnapshotKind.AUTO.value,
        box_snapshots.c.id != record.id)).scalars().all()
    drop_unneeded(conn, box_id, list(previous))
    return SnapshotStored(snapshot_id=record.id, bytes=record.bytes,
                          incremental=record.incremental)


@retry_conflicts
def store_snapshot(store: Store, site: Site, box_id: str, epoch: int, kind: SnapshotKind,
                   parts: Iterable[bytes], max_bytes: int,
                   parent_id: str | None = None) -> SnapshotStored:
    """Store a full archive, or (with `parent_id`) a delta of an earlier snapshot of the
    same box. A parent that is gone is a ConflictError `snapshot_parent_not_found`: the
    host sends a full archive instead."""
    with store.write() as conn:
        row = _held_for_snapshot(conn, site, box_id, epoch)
        return _record_snapshot(conn, box_id, row.tenant_id, kind, parts, max_bytes,
                                parent_id)


def _too_large(max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the snapshot is larger than the limit of {max_bytes} bytes",
                                code="snapshot_too_large")


@retry_conflicts
def store_snapshot_part(store: Store, site: Site, box_id: str, epoch: int, upload_id: str,
                        seq: int, data: bytes, max_bytes: int, now: float) -> None:
    """One part of an upload (sent again: replaced). The parts together may not pass
    `max_bytes` (413, for good: the host fails the snapshot rather than sending it again)."""
    with store.write() as conn:
        _held_for_snapshot(conn, site, box_id, epoch)
        if conn.execute(select(box_snapshots.c.id).where(
                box_snapshots.c.id == upload_id)).first() is not None:
            raise ConflictError(f"upload {upload_id} is committed already",
                                code="upload_committed")
        owner = conn.execute(select(box_snapshot_uploads.c.box_id).where(
            box_snapshot_uploads.c.id == upload_id)).scalar()
        if owner is None:
            conn.execute(insert(box_snapshot_uploads).values(id=upload_id, box_id=box_id,
                                                             started_at=now))
        elif owner != box_id:
            raise ConflictError(f"upload {upload_id} is another box's", code="stale_epoch")
        others = conn.execute(select(func.coalesce(func.sum(func.length(
            file_chunks.c.data)), 0)).where(file_chunks.c.file_id == upload_id,
                                           file_chunks.c.seq != seq)).scalar() or 0
        if int(others) + len(data) > max_bytes:
            raise _too_large(max_bytes)
        conn.execute(delete(file_chunks).where(file_chunks.c.file_id == upload_id,
                                               file_chunks.c.seq == seq))
        conn.execute(insert(file_chunks).values(file_id=upload_id, seq=seq, data=data))


def upload_head(store: Store, upload_id: str, max_bytes: int) -> Iterator[bytes]:
    """An upload's parts in order, for reading its start (a delta's header)."""
    read = 0
    seq = 0
    while read < max_bytes:
        with store.read() as conn:
            data = conn.execute(select(file_chunks.c.data).where(
                file_chunks.c.file_id == upload_id, file_chunks.c.seq == seq)).scalar()
        if data is None:
            return
        read += len(data)
        seq += 1
        yield bytes(data)


@retry_conflicts
def commit_snapshot(store: Store, site: Site, box_id: str, epoch: int, kind: SnapshotKind,
                    upload_id: str, parts: int, max_bytes: int,
                    parent_id: str | None) -> SnapshotStored:
    """An upload's parts 0 .. parts - 1 become the box's latest snapshot, under the upload's
    id. Committed already (an answer lost): the same answer."""
    with store.write() as conn:
        done = conn.execute(select(box_snapshots).where(
            box_snapshots.c.id == upload_id, box_snapshots.c.box_id == box_id)).first()
        if done is not None:
            return SnapshotStored(snapshot_id=done.id, bytes=done.bytes,
                                  incremental=done.parent_id is not None)
        row = _held_for_snapshot(conn, site, box_id, epoch)
        if conn.execute(select(box_snapshot_uploads.c.id).where(
                box_snapshot_uploads.c.id == upload_id,
                box_snapshot_uploads.c.box_id == box_id)).first() is None:
            raise InvalidRequestError(f"no upload {upload_id} of box {box_id}",
                                      param="upload", code="upload_not_found")
        sizes = conn.execute(select(file_chunks.c.seq, func.length(file_chunks.c.data)).where(
            file_chunks.c.file_id == upload_id).order_by(file_chunks.c.seq)).tuples().all()
        if [seq for seq, _ in sizes] != list(range(parts)):
            raise InvalidRequestError(f"upload {upload_id} has {len(sizes)} parts, not the "
                                      f"{parts} it names", param="parts",
                                      code="incomplete_upload")
        if sum(int(n) for _, n in sizes) > max_bytes:
            raise _too_large(max_bytes)
        conn.execute(delete(box_snapshot_uploads).where(box_snapshot_uploads.c.id == upload_id))
        return _record_snapshot(conn, box_id, row.tenant_id, kind, [], max_bytes, parent_id,
                                snapshot_id=upload_id)


def drop_stale_uploads(conn: Connection, now: float) -> int:
    stale = conn.execute(select(box_snapshot_uploads.c.id).where(
        box_snapshot_uploads.c.started_at < now - UPLOAD_TTL_S)).scalars().all()
    if stale:
        conn.execute(delete(file_chunks).where(file_chunks.c.file_id.in_(stale)))
        conn.execute(delete(box_snapshot_uploads).where(box_snapshot_uploads.c.id.in_(stale)))
    return len(stale)
