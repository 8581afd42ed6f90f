"""The Responses API: create (foreground, background, streamed), retrieve (or stream again
from a sequence number), cancel, delete, and list input items."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from minimill.api.deps import ConfigDep, StoreDep, TenantDep, WatcherDep
from minimill.api.errors import error_responses
from minimill.api.progress import ProgressWatcher
from minimill.api.rate_headers import remember
from minimill.api.realtime import WorkerReportedError
from minimill.api.response_schemas import InputItemList, ResponseDeleted, ResponseObject
from minimill.api.responses_live import EVENT_STREAM_RESPONSE, ResponseEventStream, wait_for_end
from minimill.control import responses
from minimill.control.body_rules import MAX_INT32
from minimill.control.errors import ConflictError, RequestTimeoutError
from minimill.control.records import RequestRecord, RequestStatus
from minimill.control.response_bodies import ResponseBody
from minimill.control.response_render import render_response
from minimill.control.store import Store
from minimill.control.tenant_limits import limits_for

router = APIRouter(prefix="/v1/responses", tags=["responses"],
                   responses=error_responses(400, 401, 404))
_HEADERS = {"Cache-Control": "no-cache"}


def _stream(request: Request, store: Store, watcher: ProgressWatcher, record: RequestRecord,
            *, starting_after: int, cancel_on_disconnect: bool) -> StreamingResponse:
    stream = ResponseEventStream(request, store, watcher, record,
                                 starting_after=starting_after,
                                 cancel_on_disconnect=cancel_on_disconnect)
    return StreamingResponse(stream.events(), media_type="text/event-stream", headers=_HEADERS)


def _raise_for(record: RequestRecord) -> None:
    """A foreground response that did not succeed answers as a failed chat call does."""
    error = record.error or {}
    if record.status == RequestStatus.FAILED:
        failure = WorkerReportedError(str(error.get("message") or "the response failed"),
                                      param=error.get("param"), code=error.get("code"))
        if error.get("code") == "server_error":
            failure.status_code, failure.error_type = 500, "server_error"
        raise failure
    if record.status == RequestStatus.EXPIRED:
        raise RequestTimeoutError("No worker finished the response in time; try again later.",
                                  code="timeout")
    raise ConflictError("The response was cancelled.", code="cancelled")


@router.post("", response_model=ResponseObject,
             responses={**EVENT_STREAM_RESPONSE, **error_responses(409, 500, 504)})
async def create_response(body: ResponseBody, request: Request, store: StoreDep,
                          tenant: TenantDep, config: ConfigDep,
                          watcher: WatcherDep) -> Response | dict[str, Any]:
    """Foreground responses answer when done (a client that leaves cancels them); background
    ones answer at once, queued, and run whatever the client does."""
    limits = await anyio.to_thread.run_sync(limits_for, store, tenant.id,
                                            config.tenant_limits)
    record, rate = await anyio.to_thread.run_sync(responses.create_response_limited, store,
                                                  tenant.id, body, config, time.time(), limits)
    remember(request, rate)
    if body.stream:
        return _stream(request, store, watcher, record, starting_after=-1,
                       cancel_on_disconnect=not body.background)
    if body.background:
        return render_response(record)
    final = await wait_for_end(request, store, watcher, record, config)
    if final is None:
        return Response(status_code=204)
    if final.status != RequestStatus.SUCCEEDED:
        _raise_for(final)
    return render_response(final)


@router.get("/{response_id}", response_model=ResponseObject, responses=EVENT_STREAM_RESPONSE)
async def retrieve_response(
    response_id: str, request: Request, store: StoreDep, tenant: TenantDep,
    watcher: WatcherDep, stream: bool = False,
    starting_after: Annotated[int | None, Query(
        ge=-1, le=MAX_INT32, description="With stream: the sequence number after which to "
        "start (the last one received).")] = None,
) -> Response | dict[str, Any]:
    record = await anyio.to_thread.run_sync(responses.get_response, store, tenant.id,
                                            response_id)
    if stream:
        after = -1 if starting_after is None else starting_after
        return _stream(request, store, watcher, record, starting_after=after,
                       cancel_on_disconnect=False)
    return render_response(record)


@router.delete("/{response_id}", response_model=ResponseDeleted)
def delete_response(response_id: str, store: StoreDep, tenant: TenantDep) -> ResponseDeleted:
    responses.delete_response(store, tenant.id, response_id)
    return ResponseDeleted(id=response_id, deleted=True)


@router.post("/{response_id}/cancel", response_model=ResponseObject,
             responses=error_responses(409))
def cancel_response(response_id: str, store: StoreDep, tenant: TenantDep) -> dict[str, Any]:
    return render_response(responses.cancel_response(store, tenant.id, response_id, time.time()))


@router.get("/{response_id}/input_items", response_model=InputItemList)
def list_input_items(response_id: str, store: StoreDep, tenant: TenantDep,
                     after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20,
                     order: Literal["asc", "desc"] = "desc") -> InputItemList:
    items, has_more = responses.list_input_items(store, tenant.id, response_id, after=after,
                                                 limit=limit, order=order)
    return InputItemList.model_validate({
        "data": items, "has_more": has_more, "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None})
