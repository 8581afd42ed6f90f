"""Wire messages between a runner (agents/runner.py) and the control plane for durable agents
(api/routes/agent_fleet.py serves, control/agents.py decides).

A runner pulls agents as workers pull requests: `/poll` extends the leases of the agents it
runs and grants new ones, each with a bumped epoch, the harness code, the task, the journal so
far, and a fresh harness credential (`mmh-`) that lives as long as the lease: the harness's
model calls and its box go through the public API with it, and it reaches nothing else (no
other agent's box, no tenant route). A poll is granted at most 32 agents whatever its capacity.
Journal appends, suspensions and
completions carry the epoch: a runner whose lease lapsed is refused. A runner that stops
gracefully `/release`s its agents at their epochs once their in-flight effects are journaled
(or abandoned): they are queued again at once instead of when their leases expire.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

AGENT_FLEET_PREFIX = "/v1/fleet/agents"

# Fencing epochs count leases of one box or agent: a 32-bit column holds any real one, and a
# larger number from a client is a 400, not a store error.
Epoch = Annotated[int, Field(ge=0, le=2**31 - 1)]


class HeldAgent(BaseModel):
    agent_id: str
    epoch: Epoch


class AgentPollRequest(BaseModel):
    capacity: int = Field(ge=0, le=4096)
    held: list[HeldAgent] = Field(default_factory=list, max_length=4096)
    wait_s: float = Field(0.0, ge=0.0, le=10.0)


class JournalEntry(BaseModel):
    key: str = Field(max_length=400)
    kind: str = Field(max_length=20)
    value: Any = None


class AgentLease(BaseModel):
    agent_id: str
    epoch: Epoch
    code: str
    filename: str
    task: Any = None
    model: str
    budget_tokens: int | None = None
    box_image: str | None = None
    # The harness credential (`mmh-...`) for this lease's calls to the public API: bound to
    # this agent and this epoch, refused once the lease ends.
    api_key: str
    journal: list[JournalEntry] = Field(default_factory=list)


class AgentPollResponse(BaseModel):
    lease_ttl_s: float
    leases: list[AgentLease] = Field(default_factory=list)
    extended: dict[str, float] = Field(default_factory=dict)
    revoked: list[str] = Field(default_factory=list)


class JournalAppend(BaseModel):
    epoch: Epoch
    entries: list[JournalEntry] = Field(max_length=1024)
    # Effects answered from the journal since the last append (counted for the operator).
    replayed: int = Field(0, ge=0, le=2**31 - 1)


class JournalAppended(BaseModel):
    # Keys already journaled (another run did the effect first): counted as repeated.
    duplicates: list[str]


class AgentFinish(BaseModel):
    epoch: Epoch
    outcome: Literal["succeeded", "failed", "sleeping"]
    result: Any = None
    error: dict[str, Any] | None = None
    # For "sleeping": not leased again before this time.
    wake_at: float | None = None


class AgentFinished(BaseModel):
    accepted: bool


class ReleasedAgent(BaseModel):
    agent_id: str
    epoch: Epoch
    # Effects this run answered from the journal since its last append (counted as an append's
    # `replayed` would be: a run that ends in a release has no later append to carry them).
    replayed: int = Field(0, ge=0, le=2**31 - 1)


class AgentRelease(BaseModel):
    agents: list[ReleasedAgent] = Field(max_length=4096)


class AgentReleased(BaseModel):
    released: list[str]
    # Not this runner's at that epoch (expired and re-leased, finished, cancelled): untouched.
    rejected: list[str]
