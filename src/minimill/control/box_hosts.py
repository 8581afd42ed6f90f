"""Boxes, the host's side (box_protocol.py): leases with fencing, operations, snapshots.

- `poll`: extend the leases of the boxes a host still holds at their epochs (the rest are
  revoked), grant it pending boxes for its free slots (epoch bumped, `restarts` counted after
  the first), and hand it the queued operations of the boxes it holds, marked running at the
  box's epoch.
- `store_output`: output of a running exec, as it comes, under the same fencing as its result.
- `complete_ops`: a result counts only from the box's host at the box's current epoch; a
  successful pause sends the box to `paused`, off its host. The operation's streamed output
  goes: the result holds all of it. Every other result is activity (box_idle.py).
- Snapshots from the host at the box's epoch become its latest (box_uploads.py: automatic
  ones replace the previous automatic one, which stays while a newer delta needs it). A
  delta (boxes/snapshots.py) names its parent, a snapshot of the same box.
- Leases carry the chain to restore (full archive first, then its deltas), and a host may
  download any archive of that chain.
- `reap_expired`: a box whose lease lapsed goes back to `pending` (to come back elsewhere from
  its latest snapshot); what its host was running fails with `box_host_lost`.

Every transition is a conditional UPDATE on status and epoch, as for requests (leases.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, case, func, select, tuple_, update

from minimill.box_protocol import (
    BoxLease,
    BoxLimits,
    BoxOp,
    BoxOutputRequest,
    BoxOutputResponse,
    BoxPollRequest,
    BoxPollResponse,
    BoxReleaseRequest,
    BoxReleaseResponse,
    BoxResultsRequest,
    BoxResultsResponse,
)
from minimill.control import box_idle, box_output, files
from minimill.control.box_records import BoxStatus, OpStatus
from minimill.control.box_uploads import drop_stale_uploads
from minimill.control.boxes import chain_of
from minimill.control.config import ControlConfig
from minimill.control.errors import (
    ConflictError,
    NotFoundError,
)
from minimill.control.records import Site
from minimill.control.store import Store, retry_conflicts
from minimill.control.tables import (
    box_ops,
    boxes,
    sites,
)

MAX_OPS_PER_POLL = 256
_RUNNING = BoxStatus.RUNNING.value
_PENDING = BoxStatus.PENDING.value
HOST_LOST = ("box_host_lost", "the box's host was lost while this ran; the box comes back on "
             "another host from its latest snapshot")


def _held_at_epoch(conn: Connection, site: Site, pairs: list[tuple[str, int]]) -> set[str]:
    if not pairs:
        return set()
    rows = conn.execute(select(boxes.c.id).where(
        boxes.c.site_id == site.id, boxes.c.status == _RUNNING,
        tuple_(boxes.c.id, boxes.c.epoch).in_(pairs))).scalars().all()
    return set(rows)


@retry_conflicts
def poll(store: Store, site: Site, ask: BoxPollRequest, now: float,
         config: ControlConfig) -> BoxPollResponse:
    expires_at = now + config.lease_ttl_s
    pairs = [(h.box_id, h.epoch) for h in ask.held]
    with store.write() as conn:
        extended: set[str] = set()
        for start in range(0, len(pairs), 500):
            extended.update(conn.execute(
                update(boxes).where(boxes.c.site_id == site.id, boxes.c.status == _RUNNING,
                                    tuple_(boxes.c.id, boxes.c.epoch).in_(
                                        pairs[start:start + 500]))
                .values(lease_expires_at=expires_at).returning(boxes.c.id)).scalars().all())
        leases = _grant(conn, site, ask.capacity, now, expires_at) if ask.capacity else []
        epochs = {h.box_id: h.epoch for h in ask.held if h.box_id in extended}
        epochs.update({lease.box_id: lease.epoch for lease in leases})
        ops = _take_ops(conn, epochs, now)
    return BoxPollResponse(
        lease_ttl_s=config.lease_ttl_s, leases=leases, ops=ops,
        extended={box_id: expires_at for box_id in extended},
        revoked=[h.box_id for h in ask.held if h.box_id not in extended])


def _grant(conn: Connection, site: Site, capacity: int, now: float,
           expires_at: float) -> list[BoxLease]:
    picked = conn.execute(
        select(boxes.c.id).where(boxes.c.status == _PENDING)
        .order_by(boxes.c.created_at).limit(capacity)
        .with_for_update(skip_locked=True)).scalars().all()
    if not picked:
        return []
    rows = conn.execute(
        update(boxes).where(boxes.c.id.in_(picked), boxes.c.status == _PENDING)
        .values(status=_RUNNING, epoch=boxes.c.epoch + 1, site_id=site.id,
                lease_expires_at=expires_at, leased_at=now,
                restarts=boxes.c.restarts + case((boxes.c.epoch > 0, 1), else_=0))
        .returning(boxes.c.id, boxes.c.epoch, boxes.c.snapshot_id, boxes.c.image_id,
                   boxes.c.network, boxes.c.limits)).all()
    return [BoxLease(box_id=r.id, epoch=r.epoch, snapshot_id=r.snapshot_id or r.image_id,
                     chain=chain_of(conn, r.snapshot_id or r.image_id),
                     network=bool(r.network), limits=BoxLimits.model_validate(r.limits or {}))
            for r in rows]


def _take_ops(conn: Connection, epochs: dict[str, int], now: float) -> list[BoxOp]:
    if not epochs:
        return []
    rows = conn.execute(
        select(box_ops.c.id, box_ops.c.box_id, box_ops.c.kind, box_ops.c.args)
        .where(box_ops.c.box_id.in_(list(epochs)), box_ops.c.status == OpStatus.QUEUED.value)
        .order_by(box_ops.c.seq).limit(MAX_OPS_PER_POLL)
        .with_for_update(skip_locked=True)).all()
    taken: list[BoxOp] = []
    for r in rows:
        hit = conn.execute(update(box_ops).where(box_ops.c.id == r.id,
                                                 box_ops.c.status == OpStatus.QUEUED.value)
                           .values(status=OpStatus.RUNNING.value, epoch=epochs[r.box_id],
                                   started_at=now)).rowcount
        if hit:
            taken.append(BoxOp(op_id=r.id, box_id=r.box_id, epoch=epochs[r.box_id],
                               kind=r.kind, args=r.args or {}))
    return taken


@retry_conflicts
def store_output(store: Store, site: Site, ask: BoxOutputRequest) -> BoxOutputResponse:
    """Store output of an exec that this host runs at the box's current epoch; anything else
    (a host whose lease lapsed, an operation that ended or went back to the queue) is a
    ConflictError."""
    with store.write() as conn:
        running = conn.execute(select(box_ops.c.id).where(
            box_ops.c.id == ask.op_id, box_ops.c.box_id == ask.box_id,
            box_ops.c.epoch == ask.epoch, box_ops.c.kind == "exec",
            box_ops.c.status == OpStatus.RUNNING.value).with_for_update()).scalar()
        if running is None or not _held_at_epoch(conn, site, [(ask.box_id, ask.epoch)]):
            raise ConflictError(f"operation {ask.op_id} is not running on this host at epoch "
                                f"{ask.epoch}", code="stale_epoch")
        stored = box_output.append(conn, ask.op_id, ask.epoch, ask.chunks)
    return BoxOutputResponse(stored=stored)


@retry_conflicts
def complete_ops(store: Store, site: Site, done: BoxResultsRequest,
                 now: float) -> BoxResultsResponse:
    accepted: list[str] = []
    rejected: list[str] = []
    with store.write() as conn:
        held = _held_at_epoch(conn, site, [(r.box_id, r.epoch) for r in done.results])
        limits = dict(conn.execute(select(boxes.c.id, boxes.c.limits).where(
            boxes.c.id.in_(held))).tuples().all()) if held else {}
        for item in done.results:
            values: dict[str, Any] = {"finished_at": now}
            if item.error is not None:
                values.update(status=OpStatus.FAILED.value, error=item.error.model_dump())
            else:
                values.update(status=OpStatus.SUCCEEDED.value, result=item.result or {})
            hit = item.box_id in held and conn.execute(
                update(box_ops).where(box_ops.c.id == item.op_id,
                                      box_ops.c.box_id == item.box_id,
                                      box_ops.c.epoch == item.epoch,
                                      box_ops.c.status == OpStatus.RUNNING.value)
                .values(**values).returning(box_ops.c.kind)).scalar()
            if not hit:
                rejected.append(item.op_id)
                continue
            accepted.append(item.op_id)
            if hit == "exec":
                box_output.drop(conn, [item.op_id])
            if hit == "pause" and item.error is None:
                _paused(conn, item.box_id, item.epoch)
            else:
                box_idle.touch(conn, item.box_id, limits.get(item.box_id), now)
    return BoxResultsResponse(accepted=accepted, rejected=rejected)


def _paused(conn: Connection, box_id: str, epoch: int) -> None:
    """A pause's snapshot is stored: the box leaves its host. One its idle policy paused that
    got operations meanwhile goes back to pending instead (a host restores it from that
    snapshot and runs them), never to a pause that would leave them waiting."""
    idle = box_idle.paused_by_idle(conn, box_id)
    waiting = idle and conn.execute(select(box_ops.c.id).where(
        box_ops.c.box_id == box_id, box_ops.c.status == OpStatus.QUEUED.value)
        .limit(1)).first() is not None
    status = _PENDING if waiting else BoxStatus.PAUSED.value
    hit = conn.execute(update(boxes).where(boxes.c.id == box_id, boxes.c.epoch == epoch,
                                           boxes.c.status == _RUNNING)
                       .values(status=status, site_id=None, lease_expires_at=None)).rowcount
    if hit and waiting:
        box_idle.clear_idle_pause(conn, box_id)
    elif hit:
        box_idle.mark_paused(conn, box_id, by_idle=idle)


def snapshot_content(store: Store, site: Site, box_id: str, snapshot_id: str) -> Iterator[bytes]:
    """An archive a host may read: one of the chain a box it holds starts from."""
    with store.read() as conn:
        box = conn.execute(select(boxes.c.snapshot_id, boxes.c.image_id).where(
            boxes.c.id == box_id, boxes.c.site_id == site.id,
            boxes.c.status == _RUNNING)).first()
        allowed = (set(chain_of(conn, box.snapshot_id)) | set(chain_of(conn, box.image_id))
                   if box is not None else set())
    if snapshot_id not in allowed:
        raise NotFoundError(f"No such snapshot for a box of this host: {snapshot_id}")
    return files.iter_chunks(store, snapshot_id)


@retry_conflicts
def release(store: Store, site: Site, ask: BoxReleaseRequest) -> BoxReleaseResponse:
    with store.write() as conn:
        released: list[str] = []
        for h in ask.boxes:
            hit = conn.execute(update(boxes).where(
                boxes.c.id == h.box_id, boxes.c.epoch == h.epoch, boxes.c.site_id == site.id,
                boxes.c.status == _RUNNING)
                .values(status=_PENDING, site_id=None, lease_expires_at=None)).rowcount
            if hit:
                released.append(h.box_id)
                _requeue_running(conn, h.box_id)
    return BoxReleaseResponse(released=released)


def _requeue_running(conn: Connection, box_id: str) -> None:
    # Handed back before it ran them: the next host runs them from the start (and what they
    # printed so far is not theirs any more).
    requeued = conn.execute(update(box_ops).where(box_ops.c.box_id == box_id,
                                                  box_ops.c.status == OpStatus.RUNNING.value)
                            .values(status=OpStatus.QUEUED.value, epoch=None, started_at=None)
                            .returning(box_ops.c.id)).scalars().all()
    box_output.drop(conn, list(requeued))


@retry_conflicts
def reap_expired(store: Store, now: float) -> int:
    """Boxes whose host stopped heartbeating go back to pending; returns how many. Uploads
    that were never committed go too."""
    with store.write() as conn:
        drop_stale_uploads(conn, now)
        lost = conn.execute(
            update(boxes).where(boxes.c.status == _RUNNING, boxes.c.lease_expires_at < now)
            .values(status=_PENDING, site_id=None, lease_expires_at=None)
            .returning(boxes.c.id)).scalars().all()
        for box_id in lost:
            code, message = HOST_LOST
            failed = conn.execute(
                update(box_ops).where(box_ops.c.box_id == box_id,
                                      box_ops.c.status == OpStatus.RUNNING.value)
                .values(status=OpStatus.FAILED.value, finished_at=now,
                        error={"code": code, "message": message})
                .returning(box_ops.c.id)).scalars().all()
            box_output.drop(conn, list(failed))
    return len(lost)


@dataclass(frozen=True, slots=True)
class SlotUse:
    """Which boxes hold host slots (operators' dashboard): running boxes by their host's
    name, and how many boxes wait for a slot."""

    held: dict[str, list[str]]
    pending: int


def slot_use(store: Store) -> SlotUse:
    with store.read() as conn:
        rows = conn.execute(select(sites.c.name, boxes.c.id).select_from(
            boxes.join(sites, sites.c.id == boxes.c.site_id))
            .where(boxes.c.status == _RUNNING).order_by(sites.c.name, boxes.c.created_at)).all()
        pending = conn.execute(select(func.count()).select_from(boxes)
                               .where(boxes.c.status == _PENDING)).scalar_one()
    held: dict[str, list[str]] = {}
    for name, box_id in rows:
        held.setdefault(name, []).append(box_id)
    return SlotUse(held=held, pending=int(pending))
