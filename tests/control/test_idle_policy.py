"""Box idle policies on a real store (SQLite and PostgreSQL), under a clock the test moves:
the janitor pauses a box only once it has gone a whole timeout without an operation and has
none queued or running; the pause goes through the box's host (a snapshot first); the next
operation resumes a box paused this way, where a box its tenant paused stays paused."""

from __future__ import annotations

import time

import pytest
from control_factory import CONFIG, site, tenant
from sqlalchemy import select

from minimill.control import box_hosts, box_idle, box_uploads, boxes
from minimill.control.box_records import BoxRecord, SnapshotKind
from minimill.control.errors import ConflictError
from minimill.control.janitor import tick
from minimill.control.records import Site
from minimill.control.store import Store
from minimill.control.tables import box_activity, box_ops
from minimill.transport.box_protocol import BoxOpResult, BoxPollRequest, BoxResultsRequest, HeldBox

LIMITS = {"cpu_s": 60, "memory_mb": 1024, "max_processes": 64, "disk_mb": 1024,
          "timeout_s": 60.0}


def new_box(store: Store, owner_id: str, timeout_s: float | None) -> BoxRecord:
    return boxes.create_box(store, owner_id, source_id=None, network=False, limits=LIMITS,
                            metadata=None, idle_timeout_s=timeout_s)


def activity(store: Store, box_id: str) -> tuple[float, float | None, bool]:
    with store.read() as conn:
        row = conn.execute(select(box_activity).where(box_activity.c.box_id == box_id)).one()
    return row.last_active_at, row.idle_at, row.idle_paused


def held(store: Store, host: Site, box_id: str, epoch: int, now: float) -> list[str]:
    """The host's poll: the kinds of the operations it is handed for the box."""
    answer = box_hosts.poll(store, host, BoxPollRequest(
        capacity=0, held=[HeldBox(box_id=box_id, epoch=epoch)]), now, CONFIG)
    return [op.kind for op in answer.ops if op.box_id == box_id]


def finish(store: Store, host: Site, box_id: str, epoch: int, now: float) -> None:
    """The host runs every operation it holds for the box (a pause stores its snapshot)."""
    with store.read() as conn:
        ops = conn.execute(select(box_ops.c.id, box_ops.c.kind).where(
            box_ops.c.box_id == box_id, box_ops.c.status == "running")).all()
    for op in ops:
        result: dict[str, object] = {"exit_code": 0}
        if op.kind == "pause":
            stored = box_uploads.store_snapshot(store, host, box_id, epoch, SnapshotKind.AUTO,
                                               [b"tar"], 100)
            result = {"snapshot_id": stored.snapshot_id}
        box_hosts.complete_ops(store, host, BoxResultsRequest(results=[BoxOpResult(
            op_id=op.id, box_id=box_id, epoch=epoch, result=result)]), now)


def test_an_idle_box_is_paused_through_its_host_and_resumed_by_its_next_op(
        store: Store) -> None:
    owner, host = tenant(store), site(store, "h")
    created = time.time()
    box = new_box(store, owner.id, 10.0)
    forever = new_box(store, owner.id, None)
    assert (box.idle_timeout_s, box.idle_action, forever.idle_timeout_s) == (10.0, "pause", None)
    assert box.limits == LIMITS  # the policy is not a per-exec limit: hosts never see it
    leases = box_hosts.poll(store, host, BoxPollRequest(capacity=2), created, CONFIG).leases
    assert sorted(lease.box_id for lease in leases) == sorted([box.id, forever.id])
    epoch = next(lease.epoch for lease in leases if lease.box_id == box.id)

    # An operation at t+5 moves the deadline to t+15; one still running holds it off.
    boxes.submit_op(store, owner.id, box.id, "exec", {"command": ["true"]})
    last = activity(store, box.id)[0]
    assert activity(store, box.id)[1] == pytest.approx(last + 10.0)
    assert held(store, host, box.id, epoch, created) == ["exec"]
    assert box_idle.pause_idle(store, last + 30) == 0  # running: not idle, however long
    finish(store, host, box.id, epoch, last + 31)
    assert activity(store, box.id)[1] == pytest.approx(last + 41)  # its end is activity too
    assert box_idle.pause_idle(store, last + 40) == 0

    # Due: the janitor asks its host to pause it (a snapshot first), once.
    assert held(store, host, box.id, epoch, last + 41) == []  # the host's lease lives on
    report = tick(store, last + 42, CONFIG, finalize_batches=False)
    assert report.idle_boxes == 1
    assert box_idle.pause_idle(store, last + 50) == 0
    assert boxes.get_box(store, owner.id, box.id).status.value == "running"
    assert held(store, host, box.id, epoch, last + 42) == ["pause"]
    finish(store, host, box.id, epoch, last + 43)
    paused = boxes.get_box(store, owner.id, box.id)
    assert paused.status.value == "paused" and paused.idle_paused
    assert paused.snapshot_id is not None
    # Its host no longer holds it: its next poll revokes it.
    answer = box_hosts.poll(store, host, BoxPollRequest(
        capacity=0, held=[HeldBox(box_id=box.id, epoch=epoch)]), last + 44, CONFIG)
    assert answer.revoked == [box.id]
    # Paused boxes are not looked at again (their deadline is cleared).
    assert activity(store, box.id)[1] is None
    # The box without a policy never is.
    assert box_idle.pause_idle(store, last + 10**9) == 0
    assert boxes.get_box(store, owner.id, forever.id).status.value != "paused"

    # Its next operation resumes it: pending, restored by a host from that snapshot.
    boxes.submit_op(store, owner.id, box.id, "read", {"path": "a.txt"})
    back = boxes.get_box(store, owner.id, box.id)
    assert back.status.value == "pending" and not back.idle_paused
    lease = box_hosts.poll(store, host, BoxPollRequest(capacity=1), time.time(),
                           CONFIG).leases[0]
    assert (lease.box_id, lease.snapshot_id, lease.epoch) == (box.id, paused.snapshot_id,
                                                              epoch + 1)


def test_a_tenants_pause_waits_for_resume_and_a_hostless_box_pauses_at_once(
        store: Store) -> None:
    owner = tenant(store)
    now = time.time()
    box = new_box(store, owner.id, 5.0)
    assert box_idle.pause_idle(store, now + 4) == 0
    # No host took it: paused in place (its files are its latest snapshot, or its image).
    assert box_idle.pause_idle(store, now + 6) == 1
    assert boxes.get_box(store, owner.id, box.id).idle_paused
    # The tenant pauses it too: from now on an operation is refused until it resumes it.
    boxes.keep_paused(store, owner.id, box.id)
    with pytest.raises(ConflictError) as err:
        boxes.submit_op(store, owner.id, box.id, "exec", {"command": ["true"]})
    assert err.value.code == "box_paused"
    resumed = boxes.resume_box(store, owner.id, box.id)
    assert resumed.status.value == "pending"
    assert activity(store, box.id)[1] is not None  # the resume counts as activity


def test_operations_queued_during_an_idle_pause_bring_the_box_back(store: Store) -> None:
    owner, host = tenant(store), site(store, "h")
    now = time.time()
    box = new_box(store, owner.id, 1.0)
    epoch = box_hosts.poll(store, host, BoxPollRequest(capacity=1), now, CONFIG).leases[0].epoch
    assert box_idle.pause_idle(store, now + 2) == 1
    assert held(store, host, box.id, epoch, now + 2) == ["pause"]
    # An exec arrives while the host snapshots it: queued after the pause.
    boxes.submit_op(store, owner.id, box.id, "exec", {"command": ["true"]})
    finish(store, host, box.id, epoch, now + 3)
    record = boxes.get_box(store, owner.id, box.id)
    assert record.status.value == "pending" and not record.idle_paused
    leases = box_hosts.poll(store, host, BoxPollRequest(capacity=1), now + 4, CONFIG).leases
    assert [lease.box_id for lease in leases] == [box.id]
