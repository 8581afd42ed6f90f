"""A stopping runner's release of its agents, on a real store (SQLite and PostgreSQL): the
agent is queued at once and the next poll leases it with its journal; the release is fenced
by the lease's epoch and site exactly like a journal append."""

from __future__ import annotations

import time

import pytest
from control_factory import CONFIG, MODEL, site, tenant
from sqlalchemy import func, select

from minimill.control import agents
from minimill.control.errors import ConflictError
from minimill.control.store import Store
from minimill.control.tables import harness_keys
from minimill.transport.agent_protocol import (
    AgentFinish,
    AgentPollRequest,
    AgentRelease,
    JournalAppend,
    JournalEntry,
    ReleasedAgent,
)


def lease_keys(store: Store, agent_id: str) -> int:
    with store.read() as conn:
        return int(conn.execute(select(func.count()).select_from(harness_keys)
                                .where(harness_keys.c.agent_id == agent_id)).scalar_one())


def test_a_released_agent_is_leased_again_at_once_with_its_journal(store: Store) -> None:
    owner, mine, other = tenant(store), site(store, "a"), site(store, "b")
    now = time.time()
    agent_id = agents.create_agent(store, owner.id, code="async def main(ctx, task): pass",
                                   filename="h.py", task=None, model=MODEL, budget_tokens=None)
    first = agents.poll(store, mine, AgentPollRequest(capacity=1), now, CONFIG).leases[0]
    agents.append(store, mine, agent_id, JournalAppend(epoch=first.epoch, entries=[
        JournalEntry(key="exec0", kind="exec", value={"exit_code": 0})]), now)
    assert lease_keys(store, agent_id) == 1

    # Fenced: a wrong epoch, or the right one from another site, changes nothing.
    for who, epoch in ((mine, first.epoch + 1), (other, first.epoch)):
        answer = agents.release(store, who, AgentRelease(agents=[
            ReleasedAgent(agent_id=agent_id, epoch=epoch)]), now)
        assert answer.released == [] and answer.rejected == [agent_id]
        assert agents.get_agent(store, owner.id, agent_id).status == "running"

    answer = agents.release(store, mine, AgentRelease(agents=[
        ReleasedAgent(agent_id=agent_id, epoch=first.epoch, replayed=3)]), now + 1)
    assert answer.released == [agent_id] and answer.rejected == []
    record = agents.get_agent(store, owner.id, agent_id)
    assert record.status == "queued"
    assert record.restarts == 1 and record.replayed_effects == 3
    assert lease_keys(store, agent_id) == 0  # the stopped run's key reaches nothing now

    # The old run is done: its appends and a second release are refused.
    with pytest.raises(ConflictError):
        agents.append(store, mine, agent_id, JournalAppend(epoch=first.epoch, entries=[
            JournalEntry(key="exec1", kind="exec", value=None)]), now + 1)
    again = agents.release(store, mine, AgentRelease(agents=[
        ReleasedAgent(agent_id=agent_id, epoch=first.epoch)]), now + 1)
    assert again.rejected == [agent_id]

    # Long before the lease's expiry (CONFIG.lease_ttl_s), another site takes it over.
    taken = agents.poll(store, other, AgentPollRequest(capacity=1), now + 2, CONFIG).leases
    assert [t.agent_id for t in taken] == [agent_id]
    assert taken[0].epoch == first.epoch + 1
    assert [e.key for e in taken[0].journal] == ["exec0"]


def test_release_leaves_finished_and_cancelled_agents_alone(store: Store) -> None:
    owner, mine = tenant(store), site(store, "a")
    now = time.time()
    ids = [agents.create_agent(store, owner.id, code="x", filename="h.py", task=i, model=MODEL,
                               budget_tokens=None) for i in range(3)]
    leases = {lease.agent_id: lease for lease in
              agents.poll(store, mine, AgentPollRequest(capacity=3), now, CONFIG).leases}
    assert agents.finish(store, mine, ids[0], AgentFinish(epoch=leases[ids[0]].epoch,
                                                          outcome="succeeded"), now)
    agents.cancel_agent(store, owner.id, ids[1])
    answer = agents.release(store, mine, AgentRelease(agents=[
        ReleasedAgent(agent_id=a, epoch=leases[a].epoch) for a in ids]), now)
    assert answer.released == [ids[2]] and answer.rejected == ids[:2]
    assert [agents.get_agent(store, owner.id, a).status for a in ids] == [
        "succeeded", "cancelled", "queued"]
