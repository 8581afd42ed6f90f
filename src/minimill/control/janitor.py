"""The janitor's work: short steps one tick at a time (reap expired leases of requests, boxes
and agents, expire overdue requests and batches, delete expired files and those whose writer or
deleter died, pause boxes their idle policy says to, clear or delete request rows whose time
is up: retention.py), and the long batch jobs (read new
batches' input files, write finished batches' output files).

Every step is a conditional UPDATE or a claimed ingest or finalization, so any number of
control-plane processes may run them at the same time. The API runs `tick` every fraction of
a second in a thread, and `run_batch_jobs` in a worker process of its own: an ingest or a
finalization parses or renders for seconds, and in the API's process it would take the GIL
from the event loop and slow every transaction that holds the store's write lock meanwhile
(heartbeats wait behind those).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

from minimill.control import agents, box_hosts, box_idle, files, retention
from minimill.control.batch_finalize import expire_due, finalize, finishable
from minimill.control.batch_load import ingest_pending
from minimill.control.config import ControlConfig
from minimill.control.leases import reap_expired
from minimill.control.prompt_count import count_uncounted
from minimill.control.requests import expire_overdue
from minimill.control.store import Store, open_store
from minimill.lifetime import set_parent_death_signal


@dataclass(frozen=True, slots=True)
class TickReport:
    reaped_leases: int
    expired_requests: int
    expired_batches: int
    finalized_batches: int
    deleted_files: int
    reaped_boxes: int = 0
    reaped_agents: int = 0
    idle_boxes: int = 0  # paused (or asked to pause) by their idle policy
    purged_requests: int = 0  # realtime rows deleted at the end of their retention


def tick(store: Store, now: float, config: ControlConfig,
         finalize_batches: bool = True) -> TickReport:
    """One round of the short steps; with `finalize_batches`, of finalization too (the API
    leaves that to its batch-jobs process)."""
    reaped = reap_expired(store, now)
    expired = expire_overdue(store, now)
    expired_batches = expire_due(store, now)
    finalized = finalize_ready(store, now, config) if finalize_batches else 0
    deleted = files.sweep(store, now, config.file_writing_ttl_s)
    reaped_boxes = box_hosts.reap_expired(store, now)
    reaped_agents = agents.reap_expired(store, now)
    idle_boxes = box_idle.pause_idle(store, now)
    purged = retention.delete_old_requests(store, now, config.request_retention_s)
    return TickReport(reaped_leases=reaped, expired_requests=expired,
                      expired_batches=expired_batches, finalized_batches=finalized,
                      deleted_files=deleted, reaped_boxes=reaped_boxes,
                      reaped_agents=reaped_agents, idle_boxes=idle_boxes,
                      purged_requests=purged)


def finalize_ready(store: Store, now: float, config: ControlConfig) -> int:
    """Write the files of every batch whose rows are all terminal; returns how many."""
    # Each batch ends at the time it is finalized, never before: `now` may be from before an
    # ingest that took seconds, and a batch cancelled meanwhile must not end before its cancel.
    return sum(finalize(store, batch_id, max(now, time.time()), config.finalize_claim_ttl_s,
                        config.file_expires_after_s)
               for batch_id in finishable(store, now, config.finalize_claim_ttl_s))


def batch_jobs(store: Store, now: float, config: ControlConfig) -> tuple[int, int]:
    """Queue the lines of batches waiting in `validating` (batch_load.py), count their prompts
    (prompt_count.py), then finalize the finished ones; returns (batches validated, batches
    finalized)."""
    validated = ingest_pending(store, now, config)
    count_uncounted(store)
    return validated, finalize_ready(store, now, config)


# The stores a batch-jobs worker process has opened, by URL. The process serves a call every
# fraction of a second: it keeps its connections rather than reconnecting and checking the
# schema (a write transaction) each time.
_process_stores: dict[str, Store] = {}


def run_batch_jobs(url: str, now: float, config: ControlConfig) -> tuple[int, int]:
    """`batch_jobs` for a worker process: on a store of its own at `url`."""
    store = _process_stores.get(url)
    if store is None:
        if not _process_stores:
            # Die with the control plane, even mid-job (SIGKILL included): a job stopped
            # anywhere loses nothing, its claim goes stale and another process resumes it.
            set_parent_death_signal(signal.SIGKILL)
        store = _process_stores[url] = open_store(url)
    return batch_jobs(store, now, config)
