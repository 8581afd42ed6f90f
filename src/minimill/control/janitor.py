"""The janitor's work, one tick at a time: reap expired leases, expire overdue requests and
batches, finalize batches whose rows are all terminal, delete expired files (and those whose
writer or deleter died).

Every step is a conditional UPDATE or a claimed finalization, so any number of control-plane
processes may run ticks at the same time. The API runs `tick` every fraction of a second, and
batch ingest (`ingest`) in a loop of its own, since one ingest may take a while.
"""

from __future__ import annotations

from dataclasses import dataclass

from minimill.control import files
from minimill.control.batch_finalize import expire_due, finalize, finishable
from minimill.control.batch_load import ingest_pending
from minimill.control.config import ControlConfig
from minimill.control.leases import reap_expired
from minimill.control.requests import expire_overdue
from minimill.control.store import Store


@dataclass(frozen=True, slots=True)
class TickReport:
    reaped_leases: int
    expired_requests: int
    expired_batches: int
    finalized_batches: int
    deleted_files: int


def tick(store: Store, now: float, config: ControlConfig) -> TickReport:
    reaped = reap_expired(store, now)
    expired = expire_overdue(store, now)
    expired_batches = expire_due(store, now)
    finalized = sum(finalize(store, batch_id, now, config.finalize_claim_ttl_s,
                             config.file_expires_after_s)
                    for batch_id in finishable(store, now, config.finalize_claim_ttl_s))
    deleted = files.sweep(store, now, config.file_writing_ttl_s)
    return TickReport(reaped_leases=reaped, expired_requests=expired,
                      expired_batches=expired_batches, finalized_batches=finalized,
                      deleted_files=deleted)


def ingest(store: Store, now: float, config: ControlConfig) -> int:
    """Queue the lines of batches waiting in `validating`; returns how many batches ended
    their validation (see batch_load.py)."""
    return ingest_pending(store, now, config)
