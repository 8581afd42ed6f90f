"""Durable agents: the tenant's side (create, get, list, logs, cancel) and the runner's side
(poll: leases with fencing epochs, journal appends, finish, release, reap).

An agent that ends (succeeded, failed or cancelled) releases the box its harness created
(journaled as its `box` effect), so that finished agents hold no box host slots; a harness
that calls `ctx.box.keep()` (a `keep_box` effect) leaves it to the tenant.

An agent's journal holds every effect of its harness under a key that names the effect's
place in the run; a runner that takes the agent over replays it: effects already journaled
are answered from it, never run again. A second append of a key is refused and counted
(`repeated_effects`, which must stay 0). Each lease comes with a fresh harness credential
(harness_keys.py), bound to the agent and the lease: it reaches only the routes a harness needs
and is refused once the lease ends, so a zombie runner's model calls and box calls stop working.
One poll grants at most MAX_AGENTS_PER_POLL agents, whatever capacity the runner claims.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, func, insert, select, tuple_, update

from minimill.agent_protocol import (
    AgentFinish,
    AgentLease,
    AgentPollRequest,
    AgentPollResponse,
    AgentRelease,
    AgentReleased,
    JournalAppend,
    JournalAppended,
    JournalEntry,
)
from minimill.control import boxes, harness_keys, quotas
from minimill.control.config import ControlConfig
from minimill.control.errors import ConflictError, NotFoundError
from minimill.control.records import Site, new_id
from minimill.control.store import Store, retry_conflicts
from minimill.control.tables import agent_journal, agents
from minimill.control.tenant_limits import TenantLimits

MAX_CODE_CHARS = 1_000_000
# Most agents one poll is granted: each lease hands a site a harness credential and a
# tenant's code, so no runner takes the whole queue in one call.
MAX_AGENTS_PER_POLL = 32
STDERR_TAIL_CHARS = 500  # of a failed box exec, in `agent logs`


class AgentStatus(StrEnum):
    QUEUED = "queued"  # waiting for a runner (new, woken, or its runner was lost)
    RUNNING = "running"  # a runner holds it at the row's epoch
    SLEEPING = "sleeping"  # ctx.sleep_until: queued again at wake_at, holding nothing
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# Journal kinds of the effects that create the agent's box and keep it past the agent's end.
BOX_EFFECT = "box"
KEEP_BOX_EFFECT = "keep_box"

TERMINAL = (AgentStatus.SUCCEEDED.value, AgentStatus.FAILED.value, AgentStatus.CANCELLED.value)


@dataclass(frozen=True, slots=True)
class AgentRecord:
    id: str
    status: str
    filename: str
    model: str
    task: Any
    result: Any
    error: Any
    budget_tokens: int | None
    restarts: int
    repeated_effects: int
    replayed_effects: int
    journaled_effects: int
    created_at: float
    finished_at: float | None


def create_agent(store: Store, tenant_id: str, *, code: str, filename: str, task: Any,
                 model: str, budget_tokens: int | None, box_image: str | None = None,
                 quota: TenantLimits | None = None) -> str:
    agent_id = new_id("agent_")
    with store.write() as conn:
        quotas.check_agents(conn, tenant_id, quota)
        conn.execute(insert(agents).values(
            id=agent_id, tenant_id=tenant_id, status=AgentStatus.QUEUED.value, code=code,
            filename=filename[:500], task=task, model=model, budget_tokens=budget_tokens,
            box_image=box_image, epoch=0, restarts=0, repeated_effects=0, replayed_effects=0,
            created_at=time.time()))
    return agent_id


def get_agent(store: Store, tenant_id: str, agent_id: str) -> AgentRecord:
    with store.read() as conn:
        row = conn.execute(select(agents).where(agents.c.id == agent_id,
                                                agents.c.tenant_id == tenant_id)).first()
        if row is None:
            raise NotFoundError(f"No such agent: {agent_id}", param="agent_id",
                                code="agent_not_found")
        counts = _journal_counts(conn, [agent_id])
    return _record(row, counts.get(agent_id, 0))


def list_agents(store: Store, tenant_id: str, limit: int = 100,
                status: str | None = None) -> list[AgentRecord]:
    """The tenant's agents, newest first (optionally only those in `status`)."""
    query = select(agents).where(agents.c.tenant_id == tenant_id)
    if status is not None:
        query = query.where(agents.c.status == status)
    with store.read() as conn:
        rows = conn.execute(query.order_by(agents.c.created_at.desc(), agents.c.id.desc())
                            .limit(limit)).all()
        counts = _journal_counts(conn, [r.id for r in rows])
    return [_record(r, counts.get(r.id, 0)) for r in rows]


def _journal_counts(conn: Connection, agent_ids: list[str]) -> dict[str, int]:
    if not agent_ids:
        return {}
    return {agent_id: int(n) for agent_id, n in conn.execute(
        select(agent_journal.c.agent_id, func.count()).where(
            agent_journal.c.agent_id.in_(agent_ids)).group_by(agent_journal.c.agent_id))}


def _record(row: Any, journaled: int) -> AgentRecord:
    return AgentRecord(id=row.id, status=row.status, filename=row.filename, model=row.model,
                       task=row.task, result=row.result, error=row.error,
                       budget_tokens=row.budget_tokens, restarts=row.restarts,
                       repeated_effects=row.repeated_effects,
                       replayed_effects=row.replayed_effects, journaled_effects=journaled,
                       created_at=row.created_at, finished_at=row.finished_at)


def journal(store: Store, tenant_id: str, agent_id: str,
            kind: str | None = None) -> list[JournalEntry]:
    get_agent(store, tenant_id, agent_id)
    query = select(agent_journal).where(agent_journal.c.agent_id == agent_id)
    if kind is not None:
        query = query.where(agent_journal.c.kind == kind)
    with store.read() as conn:
        rows = conn.execute(query.order_by(agent_journal.c.created_at)).all()
    return [JournalEntry(key=r.key, kind=r.kind, value=r.value) for r in rows]


def log_lines(store: Store, tenant_id: str, agent_id: str) -> list[tuple[str, str]]:
    """What `agent logs` shows, as (journal key, message): the harness's ctx.log lines, each
    box exec that failed (its exit code and the tail of its stderr), and how a failed agent
    ended, in order."""
    record = get_agent(store, tenant_id, agent_id)
    lines = []
    for entry in journal(store, tenant_id, agent_id):
        if entry.kind == "log":
            lines.append((entry.key, str(entry.value)))
        elif entry.kind == "exec" and isinstance(entry.value, dict) and (
                entry.value.get("exit_code") != 0 or entry.value.get("error")):
            lines.append((entry.key, _failed_exec(entry.value)))
    if record.status == AgentStatus.FAILED.value and isinstance(record.error, dict):
        lines.append(("error", f"failed: {record.error.get('message') or ''}".strip()))
    return lines


def _failed_exec(result: dict[str, Any]) -> str:
    stderr = str(result.get("stderr") or "").strip()[-STDERR_TAIL_CHARS:]
    error = f" ({result['error']})" if result.get("error") else ""
    return (f"box exec exited {result.get('exit_code')}{error}"
            + (f"; stderr: {stderr}" if stderr else ""))


@retry_conflicts
def cancel_agent(store: Store, tenant_id: str, agent_id: str) -> AgentRecord:
    with store.write() as conn:
        hit = conn.execute(update(agents).where(
            agents.c.id == agent_id, agents.c.tenant_id == tenant_id,
            agents.c.status.not_in(TERMINAL))
            .values(status=AgentStatus.CANCELLED.value, finished_at=time.time(),
                    site_id=None, lease_expires_at=None, epoch=agents.c.epoch + 1)).rowcount
        if hit:
            _drop_keys(conn, agent_id)
            _release_boxes(conn, tenant_id, agent_id)
    return get_agent(store, tenant_id, agent_id)


def _drop_keys(conn: Connection, agent_id: str) -> None:
    harness_keys.drop(conn, agent_id)


def _release_boxes(conn: Connection, tenant_id: str, agent_id: str) -> list[str]:
    """Delete the boxes an ending agent created, unless its harness asked to keep them;
    returns the ids deleted."""
    made = dict(conn.execute(select(agent_journal.c.kind, agent_journal.c.value).where(
        agent_journal.c.agent_id == agent_id,
        agent_journal.c.kind.in_((BOX_EFFECT, KEEP_BOX_EFFECT)))).all())
    box_id = made.get(BOX_EFFECT)
    if not isinstance(box_id, str) or made.get(KEEP_BOX_EFFECT):
        return []
    return [box_id] if boxes.delete_in(conn, tenant_id, box_id) else []


@retry_conflicts
def poll(store: Store, site: Site, ask: AgentPollRequest, now: float,
         config: ControlConfig) -> AgentPollResponse:
    expires_at = now + config.lease_ttl_s
    pairs = [(h.agent_id, h.epoch) for h in ask.held]
    running = AgentStatus.RUNNING.value
    with store.write() as conn:
        extended: set[str] = set()
        if pairs:
            extended.update(conn.execute(
                update(agents).where(agents.c.site_id == site.id, agents.c.status == running,
                                     tuple_(agents.c.id, agents.c.epoch).in_(pairs))
                .values(lease_expires_at=expires_at).returning(agents.c.id)).scalars().all())
        capacity = min(ask.capacity, MAX_AGENTS_PER_POLL)
        leases = _grant(conn, site, capacity, now, expires_at) if capacity else []
    return AgentPollResponse(lease_ttl_s=config.lease_ttl_s, leases=leases,
                             extended={a: expires_at for a in extended},
                             revoked=[h.agent_id for h in ask.held
                                      if h.agent_id not in extended])


def _grant(conn: Connection, site: Site, capacity: int, now: float,
           expires_at: float) -> list[AgentLease]:
    picked = conn.execute(
        select(agents.c.id).where(agents.c.status == AgentStatus.QUEUED.value,
                                  (agents.c.wake_at.is_(None)) | (agents.c.wake_at <= now))
        .order_by(agents.c.created_at).limit(capacity)
        .with_for_update(skip_locked=True)).scalars().all()
    leases = []
    for agent_id in picked:
        row = conn.execute(
            update(agents).where(agents.c.id == agent_id,
                                 agents.c.status == AgentStatus.QUEUED.value)
            .values(status=AgentStatus.RUNNING.value, epoch=agents.c.epoch + 1,
                    site_id=site.id, lease_expires_at=expires_at, wake_at=None)
            .returning(agents.c.id, agents.c.tenant_id, agents.c.epoch, agents.c.code,
                       agents.c.filename, agents.c.task, agents.c.model,
                       agents.c.budget_tokens, agents.c.box_image)).first()
        if row is None:
            continue
        _drop_keys(conn, agent_id)
        entries = conn.execute(select(agent_journal.c.key, agent_journal.c.kind,
                                      agent_journal.c.value)
                               .where(agent_journal.c.agent_id == agent_id)).all()
        leases.append(AgentLease(
            agent_id=row.id, epoch=row.epoch, code=row.code, filename=row.filename,
            task=row.task, model=row.model, budget_tokens=row.budget_tokens,
            box_image=row.box_image,
            api_key=harness_keys.mint(conn, row.tenant_id, agent_id, row.epoch, now),
            journal=[JournalEntry(key=e.key, kind=e.kind, value=e.value) for e in entries]))
    return leases


def _held(conn: Connection, site: Site, agent_id: str, epoch: int) -> bool:
    return conn.execute(select(agents.c.id).where(
        agents.c.id == agent_id, agents.c.epoch == epoch, agents.c.site_id == site.id,
        agents.c.status == AgentStatus.RUNNING.value)).first() is not None


@retry_conflicts
def append(store: Store, site: Site, agent_id: str, ask: JournalAppend,
           now: float) -> JournalAppended:
    duplicates: list[str] = []
    with store.write() as conn:
        if not _held(conn, site, agent_id, ask.epoch):
            raise ConflictError(f"agent {agent_id} is not this runner's at epoch {ask.epoch}",
                                code="stale_epoch")
        keys = [e.key for e in ask.entries]
        present = set(conn.execute(select(agent_journal.c.key).where(
            agent_journal.c.agent_id == agent_id, agent_journal.c.key.in_(keys)))
            .scalars().all()) if keys else set()
        for i, entry in enumerate(ask.entries):
            if entry.key in present:
                duplicates.append(entry.key)
                continue
            present.add(entry.key)
            conn.execute(insert(agent_journal).values(
                agent_id=agent_id, key=entry.key, kind=entry.kind, value=entry.value,
                epoch=ask.epoch, created_at=now + i * 1e-6))
        if duplicates or ask.replayed:
            conn.execute(update(agents).where(agents.c.id == agent_id).values(
                repeated_effects=agents.c.repeated_effects + len(duplicates),
                replayed_effects=agents.c.replayed_effects + ask.replayed))
    return JournalAppended(duplicates=duplicates)


@retry_conflicts
def finish(store: Store, site: Site, agent_id: str, done: AgentFinish, now: float) -> bool:
    values: dict[str, Any] = {"site_id": None, "lease_expires_at": None}
    if done.outcome == "sleeping":
        values.update(status=AgentStatus.SLEEPING.value, wake_at=done.wake_at or now)
    else:
        values.update(status=done.outcome, result=done.result, error=done.error,
                      finished_at=now)
    with store.write() as conn:
        tenant_id = conn.execute(update(agents).where(
            agents.c.id == agent_id, agents.c.epoch == done.epoch, agents.c.site_id == site.id,
            agents.c.status == AgentStatus.RUNNING.value).values(**values)
            .returning(agents.c.tenant_id)).scalar()
        if tenant_id is not None:
            _drop_keys(conn, agent_id)
            if done.outcome != "sleeping":
                _release_boxes(conn, tenant_id, agent_id)
    return tenant_id is not None


@retry_conflicts
def release(store: Store, site: Site, ask: AgentRelease, now: float) -> AgentReleased:
    """A stopping runner gives its agents back: each one still this site's at the sent epoch
    is queued again at once (its lease key dropped, so the stopped run can do nothing more) and
    resumes on the next runner that polls, from its journal. Anything else is rejected and left
    as it is: a release is fenced exactly like a journal append."""
    released: list[str] = []
    rejected: list[str] = []
    with store.write() as conn:
        for item in ask.agents:
            hit = conn.execute(update(agents).where(
                agents.c.id == item.agent_id, agents.c.epoch == item.epoch,
                agents.c.site_id == site.id, agents.c.status == AgentStatus.RUNNING.value)
                .values(status=AgentStatus.QUEUED.value, site_id=None, lease_expires_at=None,
                        restarts=agents.c.restarts + 1,
                        replayed_effects=agents.c.replayed_effects + item.replayed)).rowcount
            if hit:
                _drop_keys(conn, item.agent_id)
            (released if hit else rejected).append(item.agent_id)
    return AgentReleased(released=released, rejected=rejected)


@retry_conflicts
def reap_expired(store: Store, now: float) -> int:
    """Agents whose runner stopped heartbeating go back to the queue; sleepers whose time
    came are queued. Returns how many agents were re-queued after a lost runner."""
    with store.write() as conn:
        lost = conn.execute(
            update(agents).where(agents.c.status == AgentStatus.RUNNING.value,
                                 agents.c.lease_expires_at < now)
            .values(status=AgentStatus.QUEUED.value, site_id=None, lease_expires_at=None,
                    restarts=agents.c.restarts + 1)
            .returning(agents.c.id)).scalars().all()
        for agent_id in lost:
            _drop_keys(conn, agent_id)
        conn.execute(update(agents).where(agents.c.status == AgentStatus.SLEEPING.value,
                                          agents.c.wake_at <= now)
                     .values(status=AgentStatus.QUEUED.value))
    return len(lost)
