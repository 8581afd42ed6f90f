"""Boxes: create (from an image or a snapshot), list, get, delete, pause, resume; exec, files
and snapshots, each an operation its host runs while the call waits for the result (or, for
an exec with `stream`, while the call streams its output: box_ops.py)."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response, StreamingResponse

from minimill.api import harness_auth
from minimill.api.box_ops import (
    PLACEMENT_GRACE_S,
    ExecStream,
    Position,
    box_timeout,
    op_failure,
)
from minimill.api.box_schemas import (
    MAX_INLINE_BYTES,
    BoxCreate,
    BoxDeleted,
    BoxList,
    BoxObject,
    ExecCreate,
    ExecResult,
    FileEntry,
    FileListing,
    FileWritten,
    SnapshotList,
    SnapshotObject,
)
from minimill.api.box_wakeup import POLL_INTERVAL_S, BoxWakeups, box_wakeups
from minimill.api.deps import ConfigDep, StoreDep, TenantDep
from minimill.api.errors import error_responses
from minimill.control import boxes
from minimill.control.box_records import BoxStatus, OpStatus
from minimill.control.errors import InvalidRequestError, PayloadTooLargeError
from minimill.control.store import Store
from minimill.control.tenant_limits import limits_for

router = APIRouter(prefix="/v1/boxes", tags=["boxes"], responses=error_responses(400, 401))
WakeupsDep = Annotated[BoxWakeups, Depends(box_wakeups)]
# A retried exec or write with the same key gets the first one's result; it runs once.
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=500)]
# Where a streamed exec's client was when it lost the stream (an event's id).
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID", max_length=200)]
_EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "string", "description": "With stream: server-sent events, each a JSON object: "
    "{type: stdout|stderr, data}, then {type: exit, exit_code, duration_s, timed_out, error, "
    "output_truncated} or {type: error, status, error}; then [DONE]."}}}


async def body_chunks(request: Request, max_bytes: int) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise PayloadTooLargeError(f"the body is larger than {max_bytes} bytes",
                                       code="body_too_large")
        yield chunk


async def _read_body(request: Request, max_bytes: int) -> bytes:
    return b"".join([c async for c in body_chunks(request, max_bytes)])


async def _run_op(store: Store, wakeups: BoxWakeups, tenant_id: str, box_id: str, kind: str,
                  args: dict[str, Any], wait_s: float,
                  idempotency_key: str | None = None) -> dict[str, Any]:
    """Queue an operation, wait for its host's result, and return it (or raise its error)."""
    op_id = await anyio.to_thread.run_sync(boxes.submit_op, store, tenant_id, box_id, kind,
                                           args, idempotency_key)
    wakeups.work.notify()
    deadline = time.monotonic() + wait_s + PLACEMENT_GRACE_S
    try:
        while True:
            op = await anyio.to_thread.run_sync(boxes.get_op, store, op_id)
            if op.status in (OpStatus.SUCCEEDED, OpStatus.FAILED):
                break
            if time.monotonic() >= deadline:
                raise box_timeout(box_id)
            await wakeups.results.wait(POLL_INTERVAL_S)
    finally:
        await asyncio.shield(anyio.to_thread.run_sync(boxes.finish_wait, store, op_id))
    if op.status == OpStatus.FAILED:
        raise op_failure(op)
    return op.result or {}


def _timeout(limits: dict[str, Any], asked: float | None) -> float:
    default = float(limits.get("timeout_s", 60.0))
    return min(asked, 7 * 24 * 3600.0) if asked is not None else default


@router.post("/images", response_model=SnapshotObject, responses=error_responses(413))
async def create_image(request: Request, store: StoreDep, tenant: TenantDep,
                       config: ConfigDep) -> SnapshotObject:
    """Upload a tar archive (optionally gzipped) as the body: boxes can start from it."""
    data = await _read_body(request, config.max_file_bytes)
    if not data:
        raise InvalidRequestError("the body must be a tar archive", code="invalid_archive")
    record = await anyio.to_thread.run_sync(boxes.create_image, store, tenant.id, [data],
                                            config.max_file_bytes)
    return SnapshotObject.of(record)


@router.post("", response_model=BoxObject, responses=error_responses(404))
async def create_box(body: BoxCreate, request: Request, store: StoreDep, tenant: TenantDep,
                     wakeups: WakeupsDep, config: ConfigDep) -> BoxObject:
    harness_auth.check_new_box(request, body.image, body.snapshot)
    # Left out, the idle timeout is the server's; an explicit null is "never".
    limits = boxes.check_limits(body.limits, config.box_caps)
    idle_timeout_s = (body.idle_timeout_s if "idle_timeout_s" in body.model_fields_set
                      else config.box_idle_timeout_s)
    quota = await anyio.to_thread.run_sync(limits_for, store, tenant.id, config.tenant_limits)
    record = await anyio.to_thread.run_sync(lambda: boxes.create_box(
        store, tenant.id, source_id=body.image or body.snapshot, network=body.network,
        limits=limits.model_dump(), metadata=body.metadata,
        idle_timeout_s=idle_timeout_s, idle_action=body.idle_action, quota=quota))
    await anyio.to_thread.run_sync(harness_auth.record_new_box, request, store, record.id)
    wakeups.work.notify()
    return BoxObject.of(record)


@router.get("", response_model=BoxList)
def list_boxes(store: StoreDep, tenant: TenantDep,
               limit: Annotated[int, Query(ge=1, le=1000)] = 1000) -> BoxList:
    return BoxList(data=[BoxObject.of(r) for r in boxes.list_boxes(store, tenant.id, limit)])


@router.get("/{box_id}", response_model=BoxObject, responses=error_responses(404))
def get_box(box_id: str, store: StoreDep, tenant: TenantDep) -> BoxObject:
    return BoxObject.of(boxes.get_box(store, tenant.id, box_id))


@router.delete("/{box_id}", response_model=BoxDeleted, responses=error_responses(404))
def delete_box(box_id: str, store: StoreDep, tenant: TenantDep) -> BoxDeleted:
    boxes.delete_box(store, tenant.id, box_id)
    return BoxDeleted(id=box_id)


@router.post("/{box_id}/exec", response_model=ExecResult, responses={
    **error_responses(404, 409, 504), 200: {"content": _EVENT_STREAM}})
async def exec_in_box(box_id: str, body: ExecCreate, request: Request, store: StoreDep,
                      tenant: TenantDep, wakeups: WakeupsDep, config: ConfigDep,
                      idempotency_key: IdempotencyKey = None,
                      last_event_id: LastEventId = None) -> ExecResult | StreamingResponse:
    """Run a command in the box and wait for it: stdout, stderr, exit code. With `stream`,
    its output as it comes (server-sent events); a client that lost the stream sends the same
    request with the same Idempotency-Key and the last event's id as Last-Event-ID."""
    position = Position.parse(last_event_id) if body.stream and last_event_id else None
    boxes.check_exec_timeout(body.timeout_s, config.box_caps)
    box = await anyio.to_thread.run_sync(boxes.get_box, store, tenant.id, box_id)
    timeout = _timeout(box.limits, body.timeout_s)
    command = ["/bin/sh", "-c", body.command] if isinstance(body.command, str) else body.command
    args = {"command": command, "stdin": body.stdin, "env": body.env, "timeout_s": timeout}
    if not body.stream:
        result = await _run_op(store, wakeups, tenant.id, box_id, "exec", args, timeout,
                               idempotency_key)
        return ExecResult.model_validate(result)
    op_id = await anyio.to_thread.run_sync(boxes.submit_op, store, tenant.id, box_id, "exec",
                                           args, idempotency_key)
    wakeups.work.notify()
    if position is None or position.op_id != op_id:
        position = Position(op_id)  # a new exec (or a re-run after its host was lost)
    stream = ExecStream(request, store, wakeups, box_id, position,
                        time.monotonic() + timeout + PLACEMENT_GRACE_S)
    return StreamingResponse(stream.events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.put("/{box_id}/files", response_model=FileWritten,
            responses=error_responses(404, 409, 413))
async def write_file(box_id: str, request: Request, store: StoreDep, tenant: TenantDep,
                     wakeups: WakeupsDep,
                     path: Annotated[str, Query(description="Workspace-relative path.")],
                     idempotency_key: IdempotencyKey = None) -> FileWritten:
    """Write the body to a file of the workspace (parent directories are created)."""
    boxes.check_path(path)
    data = await _read_body(request, MAX_INLINE_BYTES)
    result = await _run_op(store, wakeups, tenant.id, box_id, "write",
                           {"path": path, "content_b64": base64.b64encode(data).decode()}, 60,
                           idempotency_key)
    return FileWritten(path=path, bytes=int(result.get("bytes", len(data))))


@router.get("/{box_id}/files/content", responses={
    **error_responses(404, 409),
    200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                               "format": "binary"}}}}})
async def read_file(box_id: str, store: StoreDep, tenant: TenantDep, wakeups: WakeupsDep,
                    path: Annotated[str, Query(description="Workspace-relative path.")],
                    ) -> Response:
    boxes.check_path(path)
    result = await _run_op(store, wakeups, tenant.id, box_id, "read", {"path": path}, 60)
    return Response(base64.b64decode(result.get("content_b64", "")),
                    media_type="application/octet-stream")


@router.get("/{box_id}/files", response_model=FileListing, responses=error_responses(404, 409))
async def list_files(box_id: str, store: StoreDep, tenant: TenantDep, wakeups: WakeupsDep,
                     path: str = ".") -> FileListing:
    boxes.check_path(path)
    result = await _run_op(store, wakeups, tenant.id, box_id, "list", {"path": path}, 60)
    return FileListing(path=path, data=[FileEntry.model_validate(e)
                                        for e in result.get("entries", [])])


@router.post("/{box_id}/snapshots", response_model=SnapshotObject,
             responses=error_responses(404, 409))
async def snapshot_box(box_id: str, store: StoreDep, tenant: TenantDep,
                       wakeups: WakeupsDep) -> SnapshotObject:
    """Archive the workspace now; a new box can be restored from it (POST /v1/boxes)."""
    result = await _run_op(store, wakeups, tenant.id, box_id, "snapshot", {}, 600)
    record = await anyio.to_thread.run_sync(boxes.get_snapshot, store, tenant.id,
                                            str(result["snapshot_id"]))
    return SnapshotObject.of(record)


@router.get("/{box_id}/snapshots", response_model=SnapshotList, responses=error_responses(404))
def list_snapshots(box_id: str, store: StoreDep, tenant: TenantDep) -> SnapshotList:
    return SnapshotList(data=[SnapshotObject.of(r)
                              for r in boxes.list_snapshots(store, tenant.id, box_id)])


@router.post("/{box_id}/pause", response_model=BoxObject, responses=error_responses(404, 409))
async def pause_box(box_id: str, store: StoreDep, tenant: TenantDep,
                    wakeups: WakeupsDep) -> BoxObject:
    """Snapshot the box and take it off its host: it holds no resources until resumed (its
    operations answer 409 `box_paused` meanwhile; a box its idle policy paused, by contrast,
    is resumed by its next operation)."""
    box = await anyio.to_thread.run_sync(boxes.get_box, store, tenant.id, box_id)
    hostless = box.status == BoxStatus.PENDING and await anyio.to_thread.run_sync(
        boxes.pause_now_if_hostless, store, tenant.id, box_id)
    if box.status == BoxStatus.PAUSED:
        await anyio.to_thread.run_sync(boxes.keep_paused, store, tenant.id, box_id)
    elif not hostless:
        await _run_op(store, wakeups, tenant.id, box_id, "pause", {}, 600)
    return BoxObject.of(await anyio.to_thread.run_sync(boxes.get_box, store, tenant.id,
                                                       box_id))


@router.post("/{box_id}/resume", response_model=BoxObject, responses=error_responses(404))
async def resume_box(box_id: str, store: StoreDep, tenant: TenantDep,
                     wakeups: WakeupsDep) -> BoxObject:
    record = await anyio.to_thread.run_sync(boxes.resume_box, store, tenant.id, box_id)
    wakeups.work.notify()
    return BoxObject.of(record)
