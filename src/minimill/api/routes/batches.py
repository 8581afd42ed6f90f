"""Batches: create, retrieve, list (after/limit pagination), cancel."""

from __future__ import annotations

import functools
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request

from minimill.api.deps import ConfigDep, StoreDep, TenantDep
from minimill.api.errors import error_responses
from minimill.api.schemas import BatchCreate, BatchList, BatchObject
from minimill.control import batches

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=error_responses(400, 401))


@router.post("", response_model=BatchObject, responses=error_responses(404))
async def create_batch(body: BatchCreate, request: Request, store: StoreDep, tenant: TenantDep,
                       config: ConfigDep) -> BatchObject:
    """Answers at once with the batch `validating`; its lines are queued in the background."""
    expires = body.output_expires_after.seconds if body.output_expires_after else None
    record = await anyio.to_thread.run_sync(functools.partial(
        batches.create_batch, store, tenant.id, body.input_file_id, body.endpoint,
        body.completion_window, body.metadata, config, output_expires_after_s=expires))
    request.app.state.ingest_wake.set()
    return BatchObject.of(record)


@router.get("", response_model=BatchList, responses=error_responses(404))
def list_batches(store: StoreDep, tenant: TenantDep, after: str | None = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> BatchList:
    page, has_more = batches.list_batches(store, tenant.id, after=after, limit=limit)
    data = [BatchObject.of(b) for b in page]
    return BatchList(data=data, has_more=has_more, first_id=data[0].id if data else None,
                     last_id=data[-1].id if data else None)


@router.get("/{batch_id}", response_model=BatchObject, responses=error_responses(404))
def retrieve_batch(batch_id: str, store: StoreDep, tenant: TenantDep) -> BatchObject:
    return BatchObject.of(batches.get_batch(store, tenant.id, batch_id))


@router.post("/{batch_id}/cancel", response_model=BatchObject,
             responses=error_responses(404, 409))
def cancel_batch(batch_id: str, store: StoreDep, tenant: TenantDep) -> BatchObject:
    return BatchObject.of(batches.cancel_batch(store, tenant.id, batch_id))
