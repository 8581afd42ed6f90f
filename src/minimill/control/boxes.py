"""Boxes, the tenant's side: create (from an image or a snapshot), list, get, delete, pause,
resume, and operations (exec, files, snapshot) queued for the box's host.

An operation is a `box_ops` row: queued here, taken by the host that holds the box (with the
box's epoch), finished by that host's result (box_hosts.py). A caller waits for the result by
watching the row. Paths are checked here too, so that an escape is refused before any host
sees it (the host checks again, against what is really on its disk).

Snapshots may be incremental (boxes/snapshots.py): a delta's row names its parent, and a box
restored from it gets the whole chain (`chain_of`: the full archive first). Dropping
snapshots (a newer automatic one replaces the previous, a deleted box's automatic ones go)
never breaks a chain: an archive that a kept snapshot still needs is kept with it
(`drop_unneeded`), and goes once nothing kept depends on it any more. Chains are short (a
host takes a full snapshot every `snapshots.FULL_EVERY`), so what is kept so is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, update

from minimill.box_protocol import CAP_NAMES, BoxLimits
from minimill.control import box_idle, box_output, files, quotas
from minimill.control.box_records import (
    TERMINAL_OP_STATUSES,
    BoxRecord,
    BoxStatus,
    OpRecord,
    OpStatus,
    OutputChunk,
    SnapshotKind,
    SnapshotRecord,
    box_record,
    op_record,
    snapshot_record,
)
from minimill.control.errors import ConflictError, InvalidRequestError, NotFoundError
from minimill.control.records import new_id
from minimill.control.store import Store, retry_conflicts
from minimill.control.tables import box_activity, box_ops, box_snapshots, boxes, file_chunks
from minimill.control.tenant_limits import TenantLimits

_LIVE = (BoxStatus.PENDING.value, BoxStatus.RUNNING.value)
_OPEN_OPS = (OpStatus.QUEUED.value, OpStatus.RUNNING.value)


def _not_found(box_id: str) -> NotFoundError:
    return NotFoundError(f"No such box: {box_id}", param="box_id", code="box_not_found")


def check_path(path: str) -> str:
    """Refuse paths that leave the workspace before any host sees them."""
    if not path or len(path) > 4096 or "\x00" in path:
        raise InvalidRequestError("path must have 1 to 4096 characters, none of them NUL",
                                  param="path", code="invalid_path")
    if ".." in path.split("/"):
        raise InvalidRequestError(f"path {path!r} contains '..': paths stay inside the "
                                  "workspace", param="path", code="path_escape")
    return path


def check_limits(limits: BoxLimits, caps: BoxLimits) -> BoxLimits:
    """The box's limits: a limit the tenant left out is the default or the operator's cap,
    whichever is lower; one it asked for over the cap is a 400 naming it (never a silent
    clamp)."""
    asked = limits.model_dump()
    for name, cap in caps.model_dump().items():
        if name not in limits.model_fields_set:
            asked[name] = min(asked[name], cap)
    limits = BoxLimits.model_validate(asked)
    for name, cap in caps.model_dump().items():
        asked = getattr(limits, name)
        if asked > cap:
            raise InvalidRequestError(
                f"limits.{name} is {asked:g}; this server allows at most {cap:g} (its operator's "
                f"--box-max-{CAP_NAMES[name]})", param=f"limits.{name}",
                code="limit_over_cap")
    return limits


def check_exec_timeout(timeout_s: float | None, caps: BoxLimits) -> None:
    if timeout_s is not None and timeout_s > caps.timeout_s:
        raise InvalidRequestError(
            f"timeout_s is {timeout_s:g}; this server allows at most {caps.timeout_s:g} "
            f"(its operator's --box-max-{CAP_NAMES['timeout_s']})", param="timeout_s",
            code="limit_over_cap")


def store_archive(conn: Connection, tenant_id: str, box_id: str | None, kind: SnapshotKind,
                  parts: Iterable[bytes], max_bytes: int,
                  parent_id: str | None = None,
                  snapshot_id: str | None = None) -> SnapshotRecord:
    """Insert an archive (image, full snapshot, or a delta of `parent_id`) inside the
    caller's transaction. With `snapshot_id`, its chunks are stored under that id already
    (an upload in parts) and `parts` is empty."""
    if snapshot_id is None:
        snapshot_id = new_id("snap_")
        size = files.insert_chunks(conn, snapshot_id, parts, max_bytes)
    else:
        size = int(conn.execute(select(func.coalesce(func.sum(func.length(
            file_chunks.c.data)), 0)).where(file_chunks.c.file_id == snapshot_id)).scalar()
            or 0)
    now = time.time()
    conn.execute(insert(box_snapshots).values(id=snapshot_id, tenant_id=tenant_id,
                                              box_id=box_id, kind=kind.value, bytes=size,
                                              created_at=now, parent_id=parent_id))
    return SnapshotRecord(id=snapshot_id, tenant_id=tenant_id, box_id=box_id, kind=kind,
                          bytes=size, created_at=now, parent_id=parent_id)


# Longer than any chain a host makes (snapshots.FULL_EVERY): past it, rows that point at each
# other would be a loop, never a chain.
MAX_CHAIN = 64


def chain_of(conn: Connection, snapshot_id: str | None) -> list[str]:
    """The archives a restore of `snapshot_id` applies, the full one first. A chain whose
    start is missing comes back as far as it goes: its restore refuses it (a delta first)."""
    chain: list[str] = []
    current = snapshot_id
    while current is not None and len(chain) < MAX_CHAIN:
        row = conn.execute(select(box_snapshots.c.parent_id).where(
            box_snapshots.c.id == current)).first()
        if row is None:
            break
        chain.append(current)
        current = row.parent_id
    chain.reverse()
    return chain


def create_image(store: Store, tenant_id: str, parts: Iterable[bytes],
                 max_bytes: int) -> SnapshotRecord:
    """A tenant's archive (tar, optionally gzipped) to create boxes from."""
    with store.write() as conn:
        return store_archive(conn, tenant_id, None, SnapshotKind.IMAGE, parts, max_bytes)


def get_snapshot(store: Store, tenant_id: str, snapshot_id: str) -> SnapshotRecord:
    with store.read() as conn:
        row = conn.execute(select(box_snapshots).where(
            box_snapshots.c.id == snapshot_id, box_snapshots.c.tenant_id == tenant_id)).first()
    if row is None:
        raise NotFoundError(f"No such image or snapshot: {snapshot_id}", param="snapshot",
                            code="snapshot_not_found")
    return snapshot_record(row)


def list_snapshots(store: Store, tenant_id: str, box_id: str) -> list[SnapshotRecord]:
    get_box(store, tenant_id, box_id)
    with store.read() as conn:
        rows = conn.execute(select(box_snapshots).where(
            box_snapshots.c.tenant_id == tenant_id, box_snapshots.c.box_id == box_id)
            .order_by(box_snapshots.c.created_at)).all()
    return [snapshot_record(r) for r in rows]


def create_box(store: Store, tenant_id: str, *, source_id: str | None, network: bool,
               limits: dict[str, Any], metadata: dict[str, Any] | None,
               idle_timeout_s: float | None = None, idle_action: str = "pause",
               quota: TenantLimits | None = None) -> BoxRecord:
    """A new box, pending a host; `source_id` is an image or a snapshot of the tenant's.
    With `idle_timeout_s`, it is paused after that long without an operation (box_idle.py)."""
    if source_id is not None:
        get_snapshot(store, tenant_id, source_id)
    box_id = new_id("box_")
    stored = box_idle.with_policy(limits, idle_timeout_s, idle_action)
    now = time.time()
    with store.write() as conn:
        quotas.check_boxes(conn, tenant_id, quota)
        conn.execute(insert(boxes).values(
            id=box_id, tenant_id=tenant_id, status=BoxStatus.PENDING.value, epoch=0,
            image_id=source_id, network=network, limits=stored, metadata=metadata,
            created_at=now, restarts=0))
        box_idle.start(conn, box_id, stored, now)
    return get_box(store, tenant_id, box_id)


def _with_activity() -> Any:
    # Boxes created before box_activity existed have no row: an outer join.
    return (select(boxes, box_activity.c.last_active_at, box_activity.c.idle_paused)
            .select_from(boxes.outerjoin(box_activity, box_activity.c.box_id == boxes.c.id)))


def get_box(store: Store, tenant_id: str, box_id: str) -> BoxRecord:
    with store.read() as conn:
        row = conn.execute(_with_activity().where(
            boxes.c.id == box_id, boxes.c.tenant_id == tenant_id,
            boxes.c.status != BoxStatus.DELETED.value)).first()
    if row is None:
        raise _not_found(box_id)
    return box_record(row)


def list_boxes(store: Store, tenant_id: str, limit: int = 1000) -> list[BoxRecord]:
    with store.read() as conn:
        rows = conn.execute(_with_activity().where(
            boxes.c.tenant_id == tenant_id, boxes.c.status != BoxStatus.DELETED.value)
            .order_by(boxes.c.created_at.desc()).limit(limit)).all()
    return [box_record(r) for r in rows]


def _fail_open_ops(conn: Connection, box_id: str, code: str, message: str,
                   statuses: tuple[str, ...] = _OPEN_OPS) -> int:
    failed = conn.execute(
        update(box_ops).where(box_ops.c.box_id == box_id, box_ops.c.status.in_(statuses))
        .values(status=OpStatus.FAILED.value, finished_at=time.time(),
                error={"code": code, "message": message})
        .returning(box_ops.c.id)).scalars().all()
    box_output.drop(conn, list(failed))
    return len(failed)


@retry_conflicts
def delete_box(store: Store, tenant_id: str, box_id: str) -> None:
    """Gone at once: its host drops the workspace at its next poll; automatic snapshots go,
    manual ones stay restorable."""
    with store.write() as conn:
        if not delete_in(conn, tenant_id, box_id):
            raise _not_found(box_id)


def delete_in(conn: Connection, tenant_id: str, box_id: str) -> bool:
    """`delete_box` inside the caller's transaction (an ending agent releases its box so);
    False when the tenant has no such box left."""
    hit = conn.execute(update(boxes).where(
        boxes.c.id == box_id, boxes.c.tenant_id == tenant_id,
        boxes.c.status != BoxStatus.DELETED.value)
        .values(status=BoxStatus.DELETED.value, site_id=None, lease_expires_at=None,
                epoch=boxes.c.epoch + 1)).rowcount
    if not hit:
        return False
    box_idle.forget(conn, box_id)
    _fail_open_ops(conn, box_id, "box_deleted", "the box was deleted")
    autos = conn.execute(select(box_snapshots.c.id).where(
        box_snapshots.c.box_id == box_id,
        box_snapshots.c.kind == SnapshotKind.AUTO.value)).scalars().all()
    drop_unneeded(conn, box_id, list(autos))
    return True


def drop_unneeded(conn: Connection, box_id: str, snapshot_ids: list[str]) -> list[str]:
    """Drop those of the box's `snapshot_ids` that no other snapshot of it needs (as a link
    of its chain); returns the ids dropped. A host makes deltas only of its own box's
    snapshots, so only the box's own snapshots can need them."""
    if not snapshot_ids:
        return []
    parents = dict(conn.execute(select(box_snapshots.c.id, box_snapshots.c.parent_id).where(
        box_snapshots.c.box_id == box_id)).tuples().all())
    dropping = set(snapshot_ids)
    needed: set[str] = set()
    for kept in parents.keys() - dropping:
        parent = parents.get(kept)
        while parent is not None and parent not in needed:
            needed.add(parent)
            parent = parents.get(parent)
    gone = sorted(dropping - needed)
    drop_archives(conn, gone)
    return gone


def drop_archives(conn: Connection, snapshot_ids: list[str]) -> None:
    if snapshot_ids:
        conn.execute(delete(box_snapshots).where(box_snapshots.c.id.in_(snapshot_ids)))
        conn.execute(delete(file_chunks).where(file_chunks.c.file_id.in_(snapshot_ids)))


@retry_conflicts
def submit_op(store: Store, tenant_id: str, box_id: str, kind: str,
              args: dict[str, Any], idempotency_key: str | None = None) -> str:
    """Queue an operation for the box's host; returns its id. With an idempotency key that
    named an operation of this box before, that operation's id (it is not run again). A box
    its idle policy paused is resumed by it; one its tenant paused is a ConflictError."""
    op_id = new_id("bop_")
    now = time.time()
    with store.write() as conn:
        if idempotency_key is not None:
            earlier = conn.execute(select(box_ops.c.id, box_ops.c.error).where(
                box_ops.c.tenant_id == tenant_id, box_ops.c.box_id == box_id,
                box_ops.c.idempotency_key == idempotency_key)).first()
            if earlier is not None and (earlier.error or {}).get("code") != "box_host_lost":
                return str(earlier.id)
            if earlier is not None:  # it never finished: the box came back without it
                conn.execute(update(box_ops).where(box_ops.c.id == earlier.id)
                             .values(idempotency_key=None))
        row = conn.execute(select(boxes.c.status, boxes.c.limits).where(
            boxes.c.id == box_id, boxes.c.tenant_id == tenant_id)).first()
        if row is None or row.status == BoxStatus.DELETED.value:
            raise _not_found(box_id)
        if row.status == BoxStatus.PAUSED.value:
            if not box_idle.paused_by_idle(conn, box_id):
                raise ConflictError(f"box {box_id} is paused: resume it first",
                                    code="box_paused")
            # Back to pending: a host restores it from the snapshot the pause took.
            conn.execute(update(boxes).where(boxes.c.id == box_id,
                                             boxes.c.status == BoxStatus.PAUSED.value)
                         .values(status=BoxStatus.PENDING.value))
            box_idle.resumed(conn, box_id, row.limits, now)
        else:
            box_idle.touch(conn, box_id, row.limits, now)
        if kind == "pause":  # the tenant's own pause: the box waits for an explicit resume
            box_idle.clear_idle_pause(conn, box_id)
        conn.execute(insert(box_ops).values(id=op_id, box_id=box_id, tenant_id=tenant_id,
                                            kind=kind, args=args, status=OpStatus.QUEUED.value,
                                            created_at=now, idempotency_key=idempotency_key))
    return op_id


def get_op(store: Store, op_id: str) -> OpRecord:
    with store.read() as conn:
        row = conn.execute(select(box_ops).where(box_ops.c.id == op_id)).first()
    if row is None:
        raise NotFoundError(f"No such operation: {op_id}")
    return op_record(row)


def read_output(store: Store, op_id: str, epoch: int,
                seq: int) -> tuple[OpRecord, list[OutputChunk]]:
    """The operation and its streamed output after (epoch, seq), in one snapshot: once it
    has ended, its output is in its result only."""
    with store.read() as conn:
        # Not its arguments: a reader asks several times a second, and stdin may be large.
        row = conn.execute(select(box_ops.c.id, box_ops.c.box_id, box_ops.c.kind,
                                  box_ops.c.status, box_ops.c.result, box_ops.c.error,
                                  box_ops.c.epoch).where(box_ops.c.id == op_id)).first()
        if row is None:
            raise NotFoundError(f"No such operation: {op_id}")
        chunks = box_output.since(conn, op_id, epoch, seq)
    return op_record(row), chunks


def finish_wait(store: Store, op_id: str) -> OpRecord:
    """After its caller stopped waiting: a finished operation's row goes (its caller has
    its result); an unfinished one is cancelled if no host took it yet."""
    with store.write() as conn:
        row = conn.execute(select(box_ops).where(box_ops.c.id == op_id)).first()
        if row is None:
            raise NotFoundError(f"No such operation: {op_id}")
        record = op_record(row)
        if record.status in TERMINAL_OP_STATUSES:
            if row.idempotency_key is None:
                conn.execute(delete(box_ops).where(box_ops.c.id == op_id))
        elif record.status == OpStatus.QUEUED and row.idempotency_key is None:
            conn.execute(update(box_ops).where(box_ops.c.id == op_id,
                                               box_ops.c.status == OpStatus.QUEUED.value)
                         .values(status=OpStatus.FAILED.value, finished_at=time.time(),
                                 error={"code": "timeout",
                                        "message": "no host took the operation in time"}))
    return record


@retry_conflicts
def pause_now_if_hostless(store: Store, tenant_id: str, box_id: str) -> bool:
    """Pause a box that no host holds (its files are its latest snapshot already)."""
    with store.write() as conn:
        hit = conn.execute(update(boxes).where(
            boxes.c.id == box_id, boxes.c.tenant_id == tenant_id,
            boxes.c.status == BoxStatus.PENDING.value)
            .values(status=BoxStatus.PAUSED.value)).rowcount
        if hit:
            box_idle.mark_paused(conn, box_id, by_idle=False)
    return bool(hit)


@retry_conflicts
def keep_paused(store: Store, tenant_id: str, box_id: str) -> None:
    """The tenant pauses a box its idle policy paused: from now on it waits for a resume."""
    with store.write() as conn:
        if conn.execute(select(boxes.c.id).where(
                boxes.c.id == box_id, boxes.c.tenant_id == tenant_id,
                boxes.c.status == BoxStatus.PAUSED.value)).first() is not None:
            box_idle.mark_paused(conn, box_id, by_idle=False)


@retry_conflicts
def resume_box(store: Store, tenant_id: str, box_id: str) -> BoxRecord:
    with store.write() as conn:
        row = conn.execute(select(boxes.c.status, boxes.c.limits).where(
            boxes.c.id == box_id, boxes.c.tenant_id == tenant_id)).first()
        if row is None or row.status == BoxStatus.DELETED.value:
            raise _not_found(box_id)
        if row.status == BoxStatus.PAUSED.value:
            conn.execute(update(boxes).where(boxes.c.id == box_id,
                                             boxes.c.status == BoxStatus.PAUSED.value)
                         .values(status=BoxStatus.PENDING.value))
            box_idle.resumed(conn, box_id, row.limits, time.time())
    return get_box(store, tenant_id, box_id)


def is_live(record: BoxRecord) -> bool:
    return record.status.value in _LIVE
