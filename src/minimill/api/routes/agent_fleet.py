"""The runner protocol's server side (transport/agent_protocol.py): poll, journal appends, finish,
release. Authenticated with the token of a site registered for agents (`--serves agents`; any
other site token is answered 403)."""

from __future__ import annotations

import time
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends

from minimill.api.box_wakeup import HOST_RECHECK_S, BoxWakeups, box_wakeups
from minimill.api.deps import AgentSiteDep, ConfigDep, StoreDep
from minimill.api.errors import error_responses
from minimill.control import agents
from minimill.transport.agent_protocol import (
    AGENT_FLEET_PREFIX,
    AgentFinish,
    AgentFinished,
    AgentPollRequest,
    AgentPollResponse,
    AgentRelease,
    AgentReleased,
    JournalAppend,
    JournalAppended,
)

router = APIRouter(prefix=AGENT_FLEET_PREFIX, tags=["fleet"],
                   responses=error_responses(400, 401, 403))
WakeupsDep = Annotated[BoxWakeups, Depends(box_wakeups)]


@router.post("/poll", response_model=AgentPollResponse)
async def poll(ask: AgentPollRequest, store: StoreDep, site: AgentSiteDep,
               config: ConfigDep, wakeups: WakeupsDep) -> AgentPollResponse:
    deadline = time.monotonic() + min(ask.wait_s, config.lease_ttl_s / 3)
    while True:
        answer = await anyio.to_thread.run_sync(agents.poll, store, site, ask, time.time(),
                                                config)
        if answer.leases or answer.revoked or time.monotonic() >= deadline:
            return answer
        await wakeups.work.wait(min(HOST_RECHECK_S, max(deadline - time.monotonic(), 0)))


@router.post("/{agent_id}/journal", response_model=JournalAppended,
             responses=error_responses(409))
def append(agent_id: str, ask: JournalAppend, store: StoreDep,
           site: AgentSiteDep) -> JournalAppended:
    return agents.append(store, site, agent_id, ask, time.time())


@router.post("/{agent_id}/finish", response_model=AgentFinished)
def finish(agent_id: str, done: AgentFinish, store: StoreDep,
           site: AgentSiteDep) -> AgentFinished:
    return AgentFinished(accepted=agents.finish(store, site, agent_id, done, time.time()))


@router.post("/release", response_model=AgentReleased)
async def release(ask: AgentRelease, store: StoreDep, site: AgentSiteDep,
                  wakeups: WakeupsDep) -> AgentReleased:
    """A stopping runner hands its agents back, each at its lease's epoch."""
    answer = await anyio.to_thread.run_sync(agents.release, store, site, ask, time.time())
    if answer.released:
        wakeups.work.notify()  # a runner waiting in its poll here takes them up at once
    return answer
