"""The lease state machine's pure rules (the store and the simulator both follow them)."""

from __future__ import annotations

from minimill.control import lease_rules as lr
from minimill.control.records import RequestStatus


def test_grant_bumps_epoch_and_only_from_queued() -> None:
    rec = lr.LeaseRecord(RequestStatus.QUEUED)
    held = lr.grant(rec, "a", now=10.0, ttl_s=30.0)
    assert held == lr.LeaseRecord(RequestStatus.LEASED, 1, "a", 40.0)
    assert lr.grant(held, "b", 11.0, 30.0) is None


def test_heartbeat_extends_only_the_holder_at_its_epoch() -> None:
    held = lr.LeaseRecord(RequestStatus.LEASED, 3, "a", 40.0)
    assert lr.extend(held, "a", 3, 20.0, 30.0) == lr.LeaseRecord(RequestStatus.LEASED, 3, "a", 50.0)
    assert lr.extend(held, "a", 2, 20.0, 30.0) is None
    assert lr.extend(held, "b", 3, 20.0, 30.0) is None


def test_expiry_requeues_and_zombie_completion_is_fenced() -> None:
    held = lr.LeaseRecord(RequestStatus.LEASED, 1, "a", 40.0)
    assert lr.expire(held, 40.0) is None  # not yet past
    queued = lr.expire(held, 40.5)
    assert queued is not None and queued.status == RequestStatus.QUEUED
    regranted = lr.grant(queued, "b", 41.0, 30.0)
    assert regranted is not None and regranted.epoch == 2
    assert lr.complete(regranted, "a", 1) == "stale_epoch"  # the zombie
    done = lr.complete(regranted, "b", 2)
    assert isinstance(done, lr.LeaseRecord) and done.status == RequestStatus.SUCCEEDED
    assert lr.complete(done, "b", 2) == "already_completed"  # exactly once
    assert lr.complete(None, "b", 2) == "unknown_request"


def test_late_completion_after_expiry_is_accepted_if_nobody_leased_since() -> None:
    queued = lr.expire(lr.LeaseRecord(RequestStatus.LEASED, 1, "a", 40.0), 50.0)
    assert queued is not None
    done = lr.complete(queued, "a", 1)
    assert isinstance(done, lr.LeaseRecord) and done.status == RequestStatus.SUCCEEDED


def test_release_only_by_holder() -> None:
    held = lr.LeaseRecord(RequestStatus.LEASED, 1, "a", 40.0)
    assert lr.release(held, "b", 1) is None
    back = lr.release(held, "a", 1)
    assert back is not None and back.status == RequestStatus.QUEUED
