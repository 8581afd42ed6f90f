"""The janitor's work, one tick at a time: reap expired leases (of requests, boxes and
agents), expire overdue requests and batches, finalize batches whose rows are all terminal.

Every step is a conditional UPDATE or a claimed finalization, so any number of control-plane
processes may run ticks at the same time. The API runs `tick` every fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass

from minimill.control import agents, box_hosts
from minimill.control.batch_finalize import expire_due, finalize, finishable
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
    reaped_boxes: int = 0
    reaped_agents: int = 0


def tick(store: Store, now: float, config: ControlConfig) -> TickReport:
    reaped = reap_expired(store, now)
    expired = expire_overdue(store, now)
    expired_batches = expire_due(store, now)
    finalized = sum(finalize(store, batch_id, now, config.finalize_claim_ttl_s)
                    for batch_id in finishable(store, now, config.finalize_claim_ttl_s))
    reaped_boxes = box_hosts.reap_expired(store, now)
    reaped_agents = agents.reap_expired(store, now)
    return TickReport(reaped_leases=reaped, expired_requests=expired,
                      expired_batches=expired_batches, finalized_batches=finalized,
                      reaped_boxes=reaped_boxes, reaped_agents=reaped_agents)
