"""Incremental box snapshots on a real store (SQLite and PostgreSQL): each delta records its
parent, leases and restores get the whole chain (full archive first), dropping snapshots never
breaks a chain a kept snapshot needs, and a store made before `parent_id` existed gains it."""

from __future__ import annotations

import time

import pytest
from control_factory import CONFIG, site, tenant
from sqlalchemy import select

from minimill.control import box_hosts, box_uploads, boxes
from minimill.control.box_records import SnapshotKind
from minimill.control.errors import ConflictError, NotFoundError
from minimill.control.records import Site
from minimill.control.store import Store, open_store
from minimill.control.tables import box_snapshots, file_chunks
from minimill.transport.box_protocol import (
    SNAPSHOT_PARENT_NOT_FOUND,
    BoxLease,
    BoxPollRequest,
    BoxReleaseRequest,
    HeldBox,
)

AUTO, MANUAL = SnapshotKind.AUTO, SnapshotKind.MANUAL
LIMITS = {"cpu_s": 60, "memory_mb": 1024, "max_processes": 64, "disk_mb": 1024,
          "timeout_s": 60.0}


def lease_of(store: Store, host: Site, box_id: str) -> BoxLease:
    leases = box_hosts.poll(store, host, BoxPollRequest(capacity=4), time.time(), CONFIG).leases
    return next(lease for lease in leases if lease.box_id == box_id)


def snap(store: Store, host: Site, lease: BoxLease, kind: SnapshotKind,
         parent: str | None = None) -> str:
    stored = box_uploads.store_snapshot(store, host, lease.box_id, lease.epoch, kind,
                                      [f"archive of {parent}".encode()], 10_000, parent)
    assert stored.incremental == (parent is not None)
    return stored.snapshot_id


def kept(store: Store, box_id: str) -> list[str]:
    with store.read() as conn:
        return list(conn.execute(select(box_snapshots.c.id).where(
            box_snapshots.c.box_id == box_id).order_by(box_snapshots.c.created_at))
            .scalars().all())


def has_content(store: Store, snapshot_id: str) -> bool:
    with store.read() as conn:
        return conn.execute(select(file_chunks.c.file_id).where(
            file_chunks.c.file_id == snapshot_id).limit(1)).first() is not None


def test_chains_are_recorded_restored_and_never_broken(store: Store) -> None:
    owner, host = tenant(store), site(store, "h")
    box = boxes.create_box(store, owner.id, source_id=None, network=False, limits=LIMITS,
                           metadata=None)
    lease = lease_of(store, host, box.id)
    assert (lease.snapshot_id, lease.chain) == (None, [])

    s0 = snap(store, host, lease, AUTO)
    s1 = snap(store, host, lease, AUTO, s0)
    # The previous automatic snapshot stays: the newer delta needs it.
    assert kept(store, box.id) == [s0, s1]
    s2 = snap(store, host, lease, MANUAL, s1)
    s3 = snap(store, host, lease, AUTO, s2)
    record = boxes.get_snapshot(store, owner.id, s3)
    assert (record.incremental, record.parent_id) == (True, s2)
    assert not boxes.get_snapshot(store, owner.id, s0).incremental
    with store.read() as conn:
        assert boxes.chain_of(conn, s3) == [s0, s1, s2, s3]

    # A full one: the automatic s3 goes; s0 and s1 stay for the manual s2.
    s4 = snap(store, host, lease, AUTO)
    assert kept(store, box.id) == [s0, s1, s2, s4]
    assert not has_content(store, s3)
    s5 = snap(store, host, lease, AUTO, s4)

    # A delta of a snapshot that is gone, or of another box's: refused, for a full one.
    for parent in (s3, "snap_nope"):
        with pytest.raises(ConflictError) as err:
            snap(store, host, lease, AUTO, parent)
        assert err.value.code == SNAPSHOT_PARENT_NOT_FOUND

    # Its host hands it back: the next lease restores the chain of its latest snapshot, and
    # a host may read every link of that chain, nothing else.
    box_hosts.release(store, host, BoxReleaseRequest(boxes=[HeldBox(box_id=box.id,
                                                                     epoch=lease.epoch)]))
    other = site(store, "h2")
    again = lease_of(store, other, box.id)
    assert (again.snapshot_id, again.chain) == (s5, [s4, s5])
    assert b"".join(box_hosts.snapshot_content(store, other, box.id, s4)) == \
        b"archive of None"
    with pytest.raises(NotFoundError):
        box_hosts.snapshot_content(store, other, box.id, s0)

    # A new box from the manual delta gets its whole chain, across automatic snapshots.
    twin = boxes.create_box(store, owner.id, source_id=s2, network=False, limits=LIMITS,
                            metadata=None)
    assert lease_of(store, other, twin.id).chain == [s0, s1, s2]
    assert b"".join(box_hosts.snapshot_content(store, other, twin.id, s0)) == \
        b"archive of None"

    # Deleting the box drops its automatic snapshots, except those the manual one needs.
    boxes.delete_box(store, owner.id, box.id)
    assert kept(store, box.id) == [s0, s1, s2]
    assert all(has_content(store, s) for s in (s0, s1, s2))
    assert not any(has_content(store, s) for s in (s4, s5))
    with store.read() as conn:
        assert boxes.chain_of(conn, s2) == [s0, s1, s2]


def test_a_store_made_before_parents_gains_the_column(store_url: str) -> None:
    store = open_store(store_url)
    try:
        owner, host = tenant(store), site(store, "h")
        box = boxes.create_box(store, owner.id, source_id=None, network=False, limits=LIMITS,
                               metadata=None)
        old = snap(store, host, lease_of(store, host, box.id), MANUAL)
        with store.write() as conn:
            conn.exec_driver_sql("ALTER TABLE box_snapshots DROP COLUMN parent_id")
    finally:
        store.close()
    store = open_store(store_url)
    try:
        record = boxes.get_snapshot(store, owner.id, old)
        assert (record.parent_id, record.incremental) == (None, False)
        with store.read() as conn:
            assert boxes.chain_of(conn, old) == [old]
    finally:
        store.close()
