"""The box host protocol's server side (box_protocol.py): poll, output, results, snapshots,
release.

Authenticated with the token of a site registered for boxes (`--serves boxes`; any other site
token is answered 403). A poll with nothing to hand out is held open up to its `wait_s`, waking
when this process queues box work.
"""

from __future__ import annotations

import time
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import StreamingResponse

from minimill.api.box_wakeup import HOST_RECHECK_S, BoxWakeups, box_wakeups
from minimill.api.deps import BoxSiteDep, ConfigDep, StoreDep
from minimill.api.errors import error_responses
from minimill.api.routes.boxes import body_chunks
from minimill.boxes import snapshots
from minimill.control import box_hosts, box_uploads
from minimill.control.box_records import SnapshotKind
from minimill.control.errors import InvalidRequestError
from minimill.control.store import Store
from minimill.transport.box_protocol import (
    BOX_FLEET_PREFIX,
    SNAPSHOT_PART_BYTES,
    SNAPSHOT_UPLOAD_ID,
    BoxOutputRequest,
    BoxOutputResponse,
    BoxPollRequest,
    BoxPollResponse,
    BoxReleaseRequest,
    BoxReleaseResponse,
    BoxResultsRequest,
    BoxResultsResponse,
    SnapshotStored,
)

router = APIRouter(prefix=BOX_FLEET_PREFIX, tags=["fleet"],
                   responses=error_responses(400, 401, 403))
WakeupsDep = Annotated[BoxWakeups, Depends(box_wakeups)]


@router.post("/poll", response_model=BoxPollResponse)
async def poll(ask: BoxPollRequest, store: StoreDep, site: BoxSiteDep, config: ConfigDep,
               wakeups: WakeupsDep) -> BoxPollResponse:
    deadline = time.monotonic() + min(ask.wait_s, config.lease_ttl_s / 3)
    while True:
        answer = await anyio.to_thread.run_sync(box_hosts.poll, store, site, ask, time.time(),
                                                config)
        if answer.leases or answer.ops or answer.revoked or time.monotonic() >= deadline:
            return answer
        await wakeups.work.wait(min(HOST_RECHECK_S, max(deadline - time.monotonic(), 0)))


@router.post("/results", response_model=BoxResultsResponse)
async def results(done: BoxResultsRequest, store: StoreDep, site: BoxSiteDep,
                  wakeups: WakeupsDep) -> BoxResultsResponse:
    answer = await anyio.to_thread.run_sync(box_hosts.complete_ops, store, site, done,
                                            time.time())
    wakeups.results.notify()
    wakeups.output.notify()
    return answer


@router.post("/output", response_model=BoxOutputResponse, responses=error_responses(409))
async def output(ask: BoxOutputRequest, store: StoreDep, site: BoxSiteDep,
                 wakeups: WakeupsDep) -> BoxOutputResponse:
    """Output of a running exec; 409 unless this host runs it at the box's current epoch."""
    answer = await anyio.to_thread.run_sync(box_hosts.store_output, store, site, ask)
    if answer.stored:
        wakeups.output.notify()
    return answer


UploadId = Annotated[str, Path(pattern=SNAPSHOT_UPLOAD_ID)]


@router.post("/{box_id}/snapshots", response_model=SnapshotStored,
             responses=error_responses(409, 413))
async def store_snapshot(box_id: str, request: Request, store: StoreDep, site: BoxSiteDep,
                         config: ConfigDep, epoch: Annotated[int, Query(ge=0, le=2**31 - 1)],
                         kind: Annotated[str, Query(pattern="^(manual|auto)$")] = "auto",
                         upload: Annotated[str | None, Query(pattern=SNAPSHOT_UPLOAD_ID)] = None,
                         parts: Annotated[int, Query(ge=1, le=2**31 - 1)] = 1,
                         ) -> SnapshotStored:
    """With `upload`: commit the parts sent to .../snapshots/uploads/{upload}/parts (no
    body). Without: the body is the whole archive (older hosts; a fleet body's limit bounds
    it). Full or incremental; accepted only at the box's current epoch. An incremental one's
    parent is the one its own header names, so that the chain recorded is the chain its
    restore checks."""
    if upload is not None:
        parent = await anyio.to_thread.run_sync(_upload_parent, store, upload)
        return await anyio.to_thread.run_sync(
            box_uploads.commit_snapshot, store, site, box_id, epoch, SnapshotKind(kind), upload,
            parts, config.max_file_bytes, parent)
    data = b"".join([c async for c in body_chunks(request, config.max_file_bytes)])
    try:
        delta = snapshots.read_delta(data)
    except snapshots.SnapshotError as exc:
        raise InvalidRequestError(str(exc), code="invalid_archive") from None
    return await anyio.to_thread.run_sync(
        box_uploads.store_snapshot, store, site, box_id, epoch, SnapshotKind(kind), [data],
        config.max_file_bytes, delta[0].parent if delta is not None else None)


def _upload_parent(store: Store, upload_id: str) -> str | None:
    """The parent an uploaded delta's header names (None: a full archive)."""
    head = box_uploads.upload_head(store, upload_id, snapshots.MAX_DELTA_HEADER_BYTES + 64)
    buffer = bytearray()

    def more(n: int) -> bytes:
        while len(buffer) < n:
            chunk = next(head, None)
            if chunk is None:
                break
            buffer.extend(chunk)
        taken = bytes(buffer[:n])
        del buffer[:n]
        return taken

    first = more(len(snapshots.DELTA_MAGIC) + 4)
    try:
        header = snapshots.delta_header(first, more)
    except snapshots.SnapshotError as exc:
        raise InvalidRequestError(str(exc), code="invalid_archive") from None
    return header.parent if header is not None else None


@router.put("/{box_id}/snapshots/uploads/{upload_id}/parts/{seq}",
            responses=error_responses(409, 413))
async def store_snapshot_part(box_id: str, upload_id: UploadId,
                              seq: Annotated[int, Path(ge=0, le=2**31 - 1)], request: Request,
                              store: StoreDep, site: BoxSiteDep, config: ConfigDep,
                              epoch: Annotated[int, Query(ge=0, le=2**31 - 1)]) -> dict[str, int]:
    """One part of a snapshot upload (SNAPSHOT_PART_BYTES at most; sent again: replaced)."""
    data = b"".join([c async for c in body_chunks(request, SNAPSHOT_PART_BYTES)])
    await anyio.to_thread.run_sync(box_uploads.store_snapshot_part, store, site, box_id, epoch,
                                   upload_id, seq, data, config.max_file_bytes, time.time())
    return {"bytes": len(data)}


@router.get("/{box_id}/snapshots/{snapshot_id}", responses=error_responses(404))
def snapshot_content(box_id: str, snapshot_id: str, store: StoreDep,
                     site: BoxSiteDep) -> StreamingResponse:
    chunks = box_hosts.snapshot_content(store, site, box_id, snapshot_id)
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.post("/release", response_model=BoxReleaseResponse)
async def release(ask: BoxReleaseRequest, store: StoreDep, site: BoxSiteDep,
                  wakeups: WakeupsDep) -> BoxReleaseResponse:
    answer = await anyio.to_thread.run_sync(box_hosts.release, store, site, ask)
    wakeups.work.notify()
    return answer
