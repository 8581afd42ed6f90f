"""Harness credentials: what a runner gets with an agent's lease for the harness's calls to the
public API (model calls, its box), in place of a tenant key.

A credential (`mmh-...`) is bound to one agent and one lease: it authenticates only while that
agent is running at the lease's epoch and the lease has not expired, so it is refused the
moment the lease ends, is taken over (a later epoch) or lapses, whatever became of the row it
is stored in (rows are dropped when the lease ends, too). It reaches only the routes a harness
needs (api/harness_auth.py decides), and of boxes only those it created itself (`agent_boxes`).
A site that runs agents therefore holds, at any time, a handful of credentials that can do
nothing but run those agents' harnesses, and nothing once it stops holding them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from sqlalchemy import Connection, delete, func, insert, select

from minimill.control.keys import hash_secret
from minimill.control.records import Tenant, new_id
from minimill.control.store import Store
from minimill.control.tables import agent_boxes, agents, api_keys, harness_keys, tenants

HARNESS_KEY_PREFIX = "mmh-"
# Boxes one agent's harness may create: one is the rule (its box outlives its runs); a run
# that died between creating it and journaling its id makes another.
MAX_BOXES_PER_AGENT = 8
_RUNNING = "running"  # agents.AgentStatus.RUNNING (that module imports this one)


@dataclass(frozen=True, slots=True)
class Harness:
    """Who calls with a live harness credential."""

    tenant: Tenant
    agent_id: str
    box_image: str | None  # the image the agent's box starts from (None: an empty box)


def mint(conn: Connection, tenant_id: str, agent_id: str, epoch: int, now: float) -> str:
    """A new credential for the agent's lease at `epoch` (shown once: only its hash is kept)."""
    key = HARNESS_KEY_PREFIX + secrets.token_urlsafe(32)
    conn.execute(insert(harness_keys).values(id=new_id("hk_"), key_hash=hash_secret(key),
                                             agent_id=agent_id, tenant_id=tenant_id,
                                             epoch=epoch, created_at=now))
    return key


def drop(conn: Connection, agent_id: str) -> None:
    """The agent's lease ended: its credentials go (and any tenant-role key an older version
    minted for it)."""
    conn.execute(delete(harness_keys).where(harness_keys.c.agent_id == agent_id))
    conn.execute(delete(api_keys).where(api_keys.c.agent_id == agent_id))


def authenticate(store: Store, key: str, now: float) -> Harness | None:
    """The agent and tenant `key` acts for, while its lease lives; None otherwise."""
    if not key.startswith(HARNESS_KEY_PREFIX):
        return None
    query = (select(harness_keys.c.agent_id, tenants.c.id, tenants.c.name, agents.c.box_image)
             .join(agents, agents.c.id == harness_keys.c.agent_id)
             .join(tenants, tenants.c.id == harness_keys.c.tenant_id)
             .where(harness_keys.c.key_hash == hash_secret(key),
                    agents.c.status == _RUNNING, agents.c.epoch == harness_keys.c.epoch,
                    agents.c.tenant_id == harness_keys.c.tenant_id,
                    agents.c.lease_expires_at >= now))
    with store.read() as conn:
        row = conn.execute(query).first()
    if row is None:
        return None
    return Harness(tenant=Tenant(id=row.id, name=row.name), agent_id=row.agent_id,
                   box_image=row.box_image)


def owns_box(store: Store, agent_id: str, box_id: str) -> bool:
    with store.read() as conn:
        return conn.execute(select(agent_boxes.c.box_id).where(
            agent_boxes.c.box_id == box_id, agent_boxes.c.agent_id == agent_id)
        ).first() is not None


def boxes_of(store: Store, agent_id: str) -> int:
    with store.read() as conn:
        return int(conn.execute(select(func.count()).select_from(agent_boxes).where(
            agent_boxes.c.agent_id == agent_id)).scalar_one())


def bind_box(store: Store, agent_id: str, box_id: str, now: float) -> None:
    """The box the agent's harness just created is the agent's."""
    with store.write() as conn:
        conn.execute(insert(agent_boxes).values(box_id=box_id, agent_id=agent_id,
                                                created_at=now))
