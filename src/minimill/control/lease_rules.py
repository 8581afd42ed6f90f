"""The lease state machine as pure functions: grant, extend (heartbeat), expire, release,
complete with a fencing epoch.

One request's lease state is a `LeaseRecord`; each transition returns the next record, or
None (or a reject reason) when the transition does not apply. leases.py and release.py run the
same rules as conditional UPDATEs on the store (their WHERE clauses are built from the status
sets and predicates below, and the reject reasons come from `reject_reason`), and the fleet
simulator (minimill.sim) applies these functions to its in-memory records, so both follow one
state machine. No I/O and no clock inside: `now` is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from minimill.control.records import TERMINAL_REQUEST_STATUSES, RequestStatus

RejectReason = Literal["stale_epoch", "unknown_request", "already_completed"]

# A lease is granted only on a queued row.
GRANTABLE = (RequestStatus.QUEUED,)
# A heartbeat extends, and a release gives back, only a lease that is still held.
HELD = (RequestStatus.LEASED,)
# A completion at the current epoch from the last holder is accepted while the row is not
# terminal: also after its lease expired, if nobody leased it since (the work is done).
COMPLETABLE = (RequestStatus.LEASED, RequestStatus.QUEUED)


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """A request's lease state."""

    status: RequestStatus
    epoch: int = 0  # fencing epoch: bumped by every grant
    site_id: str | None = None  # the site that holds (or last held) it
    expires_at: float | None = None  # while leased


def holds(record: LeaseRecord, site_id: str, epoch: int) -> bool:
    """Is `site_id` the holder (or last holder) at `epoch`?"""
    return record.site_id == site_id and record.epoch == epoch


def grant(record: LeaseRecord, site_id: str, now: float, ttl_s: float) -> LeaseRecord | None:
    """Lease a queued request to `site_id`, bumping the fencing epoch."""
    if record.status not in GRANTABLE:
        return None
    return LeaseRecord(RequestStatus.LEASED, record.epoch + 1, site_id, now + ttl_s)


def extend(record: LeaseRecord, site_id: str, epoch: int, now: float,
           ttl_s: float) -> LeaseRecord | None:
    """A heartbeat: the holder at the current epoch keeps its lease `ttl_s` longer."""
    if record.status not in HELD or not holds(record, site_id, epoch):
        return None
    return replace(record, expires_at=now + ttl_s)


def is_expired(record: LeaseRecord, now: float) -> bool:
    return (record.status in HELD and record.expires_at is not None
            and record.expires_at < now)


def expire(record: LeaseRecord, now: float) -> LeaseRecord | None:
    """An expired lease sends the request back to the queue (keeping its last holder and
    epoch: that holder may still complete it until somebody else leases it)."""
    if not is_expired(record, now):
        return None
    return replace(record, status=RequestStatus.QUEUED, expires_at=None)


def release(record: LeaseRecord, site_id: str, epoch: int) -> LeaseRecord | None:
    """The holder gives the lease back before it finishes: queued again at once."""
    if record.status not in HELD or not holds(record, site_id, epoch):
        return None
    return replace(record, status=RequestStatus.QUEUED, expires_at=None)


def reject_reason(status: RequestStatus | None) -> RejectReason:
    """Why a completion that did not apply was rejected, from the row's status (None: no
    such row)."""
    if status is None:
        return "unknown_request"
    if status in TERMINAL_REQUEST_STATUSES:
        return "already_completed"
    return "stale_epoch"


def complete(record: LeaseRecord | None, site_id: str, epoch: int,
             succeeded: bool = True) -> LeaseRecord | RejectReason:
    """Accept a completion carrying `epoch` from `site_id`: the first valid one wins, a
    zombie's late answer (an older epoch, another site) is rejected."""
    if record is None:
        return reject_reason(None)
    if record.status in COMPLETABLE and holds(record, site_id, epoch):
        status = RequestStatus.SUCCEEDED if succeeded else RequestStatus.FAILED
        return replace(record, status=status, expires_at=None)
    return reject_reason(record.status)
