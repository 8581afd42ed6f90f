"""Durable agents: start a harness (its code and a task), follow it, read its log, cancel it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from minimill.api.deps import ConfigDep, StoreDep, TenantDep
from minimill.api.errors import error_responses
from minimill.control import agents, boxes
from minimill.control.errors import NotFoundError
from minimill.control.tenant_limits import limits_for

router = APIRouter(prefix="/v1/agents", tags=["agents"], responses=error_responses(400, 401))


class AgentCreate(BaseModel):
    code: str = Field(min_length=1, max_length=agents.MAX_CODE_CHARS,
                      description="Python source defining `async def main(ctx, task)`.")
    filename: str = Field("harness.py", max_length=500)
    task: Any = None
    model: str | None = Field(None, description="Model ctx.chat uses by default.")
    budget_tokens: int | None = Field(None, ge=1, description="Tokens the agent may spend.")
    box_image: str | None = Field(None, description="An image (POST /v1/boxes/images) the "
                                  "agent's box starts from.")


class AgentObject(BaseModel):
    id: str
    object: Literal["agent"] = "agent"
    status: str
    filename: str
    model: str
    task: Any
    result: Any
    error: Any
    budget_tokens: int | None
    restarts: int
    journaled_effects: int
    replayed_effects: int
    repeated_effects: int
    created_at: int
    finished_at: int | None

    @classmethod
    def of(cls, r: agents.AgentRecord) -> AgentObject:
        return cls(id=r.id, status=r.status, filename=r.filename, model=r.model, task=r.task,
                   result=r.result, error=r.error, budget_tokens=r.budget_tokens,
                   restarts=r.restarts, journaled_effects=r.journaled_effects,
                   replayed_effects=r.replayed_effects, repeated_effects=r.repeated_effects,
                   created_at=int(r.created_at),
                   finished_at=int(r.finished_at) if r.finished_at else None)


class AgentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AgentObject]


class JournalObject(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]


@router.post("", response_model=AgentObject, responses=error_responses(404))
def create_agent(body: AgentCreate, store: StoreDep, tenant: TenantDep,
                 config: ConfigDep) -> AgentObject:
    model = body.model or config.served_models[0]
    if model not in config.served_models:
        raise NotFoundError(f"The model `{model}` does not exist", param="model",
                            code="model_not_found")
    if body.box_image is not None:
        boxes.get_snapshot(store, tenant.id, body.box_image)
    agent_id = agents.create_agent(store, tenant.id, code=body.code, filename=body.filename,
                                   task=body.task, model=model,
                                   budget_tokens=body.budget_tokens, box_image=body.box_image,
                                   quota=limits_for(store, tenant.id, config.tenant_limits))
    return AgentObject.of(agents.get_agent(store, tenant.id, agent_id))


@router.get("", response_model=AgentList)
def list_agents(store: StoreDep, tenant: TenantDep,
                limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                status: Annotated[agents.AgentStatus | None, Query(
                    description="Only agents in this status.")] = None) -> AgentList:
    """Your agents, newest first."""
    records = agents.list_agents(store, tenant.id, limit,
                                 status.value if status is not None else None)
    return AgentList(data=[AgentObject.of(r) for r in records])


@router.get("/{agent_id}", response_model=AgentObject, responses=error_responses(404))
def get_agent(agent_id: str, store: StoreDep, tenant: TenantDep) -> AgentObject:
    return AgentObject.of(agents.get_agent(store, tenant.id, agent_id))


@router.get("/{agent_id}/logs", response_model=JournalObject, responses=error_responses(404))
def agent_logs(agent_id: str, store: StoreDep, tenant: TenantDep) -> JournalObject:
    """What the harness recorded with ctx.log, the box execs that failed and how a failed
    agent ended, in order."""
    lines = agents.log_lines(store, tenant.id, agent_id)
    return JournalObject(data=[{"key": key, "message": text} for key, text in lines])


@router.get("/{agent_id}/journal", response_model=JournalObject, responses=error_responses(404))
def agent_journal(agent_id: str, store: StoreDep, tenant: TenantDep) -> JournalObject:
    """Every effect journaled so far: key (its place in the run), kind, value."""
    entries = agents.journal(store, tenant.id, agent_id)
    return JournalObject(data=[e.model_dump() for e in entries])


@router.post("/{agent_id}/cancel", response_model=AgentObject, responses=error_responses(404))
def cancel_agent(agent_id: str, store: StoreDep, tenant: TenantDep) -> AgentObject:
    return AgentObject.of(agents.cancel_agent(store, tenant.id, agent_id))
