"""Idle boxes: each box's last activity, and its idle policy applied by the janitor.

A box has no lifetime limit; what it may have is an idle policy, set when it is created
(`idle_timeout_s`, else the server's default; None: never) and kept in its row's `limits` JSON
(box_records.IDLE_KEY). Activity is any operation on the box: asked for (`submit_op`),
finished by its host, or a resume. Each one moves the box's `box_activity.idle_at` to
now + its timeout. The janitor (`pause_idle`) pauses the boxes whose `idle_at` passed and
that have nothing queued or running: a held box gets a pause operation (its host snapshots
it and lets it go), a box no host holds is paused at once (its files are its latest snapshot).

A box paused this way is resumed by its next operation (same id, restored from that
snapshot), where a box its tenant paused answers 409 `box_paused` until resumed.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, exists, insert, select, update

from minimill.control.box_records import (
    IDLE_KEY,
    BoxStatus,
    OpStatus,
    idle_timeout,
)
from minimill.control.records import new_id
from minimill.control.store import Store, retry_conflicts
from minimill.control.tables import box_activity, box_ops, boxes

MAX_PAUSES_PER_TICK = 100
_OPEN_OPS = (OpStatus.QUEUED.value, OpStatus.RUNNING.value)


def with_policy(limits: dict[str, Any], timeout_s: float | None,
                action: str) -> dict[str, Any]:
    """The `limits` JSON of a new box, its idle policy included."""
    return {**limits, IDLE_KEY: {"timeout_s": timeout_s, "action": action}}


def start(conn: Connection, box_id: str, limits: dict[str, Any], now: float) -> None:
    """The activity row of a new box: created counts as used."""
    conn.execute(insert(box_activity).values(box_id=box_id, last_active_at=now,
                                             idle_at=_due(limits, now), idle_paused=False))


def touch(conn: Connection, box_id: str, limits: dict[str, Any] | None, now: float) -> None:
    """The box was used now: its idle policy is due a whole timeout from now."""
    conn.execute(update(box_activity).where(box_activity.c.box_id == box_id)
                 .values(last_active_at=now, idle_at=_due(limits, now)))


def mark_paused(conn: Connection, box_id: str, *, by_idle: bool) -> None:
    """A paused box is not due again (until it is used); `by_idle`: its next operation may
    resume it."""
    conn.execute(update(box_activity).where(box_activity.c.box_id == box_id)
                 .values(idle_at=None, idle_paused=by_idle))


def clear_idle_pause(conn: Connection, box_id: str) -> None:
    """Not (or no longer) paused by its idle policy: its tenant asked for a pause (the box
    then waits for a resume), or it is back on a host."""
    conn.execute(update(box_activity).where(box_activity.c.box_id == box_id)
                 .values(idle_paused=False))


def paused_by_idle(conn: Connection, box_id: str) -> bool:
    return bool(conn.execute(select(box_activity.c.idle_paused)
                             .where(box_activity.c.box_id == box_id)).scalar())


def resumed(conn: Connection, box_id: str, limits: dict[str, Any] | None, now: float) -> None:
    """Resumed (by its tenant, or by an operation after an idle pause)."""
    conn.execute(update(box_activity).where(box_activity.c.box_id == box_id)
                 .values(last_active_at=now, idle_at=_due(limits, now), idle_paused=False))


def forget(conn: Connection, box_id: str) -> None:
    conn.execute(box_activity.delete().where(box_activity.c.box_id == box_id))


def _due(limits: dict[str, Any] | None, now: float) -> float | None:
    timeout = idle_timeout(limits)
    return None if timeout is None else now + timeout


@retry_conflicts
def pause_idle(store: Store, now: float) -> int:
    """Apply the idle policy of every box that is due; returns how many were paused (or
    asked to pause)."""
    open_ops = exists().where(box_ops.c.box_id == boxes.c.id,
                              box_ops.c.status.in_(_OPEN_OPS))
    live = (BoxStatus.RUNNING.value, BoxStatus.PENDING.value)
    with store.write() as conn:
        due = conn.execute(
            select(boxes.c.id, boxes.c.tenant_id, boxes.c.status)
            .join(box_activity, box_activity.c.box_id == boxes.c.id)
            .where(box_activity.c.idle_at < now, boxes.c.status.in_(live), ~open_ops)
            .limit(MAX_PAUSES_PER_TICK)
            .with_for_update(of=boxes, skip_locked=True)).all()
        for box in due:
            if box.status == BoxStatus.PENDING.value:
                conn.execute(update(boxes).where(boxes.c.id == box.id,
                                                 boxes.c.status == BoxStatus.PENDING.value)
                             .values(status=BoxStatus.PAUSED.value))
            else:
                # Its host snapshots it, then the pause's result takes it off the host.
                conn.execute(insert(box_ops).values(
                    id=new_id("bop_"), box_id=box.id, tenant_id=box.tenant_id, kind="pause",
                    args={"reason": "idle"}, status=OpStatus.QUEUED.value, created_at=now))
            mark_paused(conn, box.id, by_idle=True)
    return len(due)
