"""A box host's HTTP client for the control plane's `/v1/fleet/boxes` routes.

Network trouble raises ControlPlaneUnavailable (the caller retries with backoff:
`transport.client.retrying`);
a 401/403 raises SiteAuthError; a 404/409 (a snapshot upload, streamed output) means the box
or the operation is no longer this host's, except an incremental snapshot's 409 saying that
its parent is gone (ParentMissing); a 400/413/422 is a refusal for good (Refused), which
fails the operation rather than being tried forever.

Snapshots travel in parts of SNAPSHOT_PART_BYTES (each its own call, sent again on its own
after a lost answer), then a commit: no body is ever larger than a part.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import httpx
from pydantic import BaseModel

from minimill.transport.box_protocol import (
    BOX_FLEET_PREFIX,
    SNAPSHOT_PARENT_NOT_FOUND,
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
from minimill.transport.client import (
    ControlPlaneUnavailable,
    SiteAuthError,
)

R = TypeVar("R", bound=BaseModel)


class NotHeld(RuntimeError):
    """The control plane says the box is not this host's at that epoch any more."""


class Refused(RuntimeError):
    """The control plane refuses the call for good (400, 413, 422): sending it again cannot
    help, so the operation it belongs to fails with this message."""


class ParentMissing(RuntimeError):
    """An incremental snapshot's parent is not the control plane's (any more): send a full
    one instead."""


def _error_code(resp: httpx.Response) -> str | None:
    try:
        error = resp.json().get("error") or {}
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code is not None else None


def _error_message(resp: httpx.Response) -> str:
    try:
        error = resp.json().get("error") or {}
        message = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        message = None
    return str(message or resp.text[:300] or f"HTTP {resp.status_code}")


class BoxHostClient:
    def __init__(self, server: str, token: str, timeout_s: float = 60.0) -> None:
        self._client = httpx.AsyncClient(
            base_url=server.rstrip("/") + BOX_FLEET_PREFIX,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s), limits=httpx.Limits(max_connections=16))

    async def _send(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        try:
            resp = await self._client.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(f"{path}: {type(exc).__name__}: {exc}") from exc
        self._check(path, resp)
        return resp

    @staticmethod
    def _check(path: str, resp: httpx.Response) -> None:
        if resp.status_code in (401, 403):
            raise SiteAuthError(f"the control plane rejected this site's token "
                                f"(HTTP {resp.status_code}): {resp.text[:300]}")
        if resp.status_code == 409 and _error_code(resp) == SNAPSHOT_PARENT_NOT_FOUND:
            raise ParentMissing(f"{path}: {resp.text[:300]}")
        if resp.status_code in (404, 409):
            raise NotHeld(f"{path}: {resp.text[:300]}")
        if resp.status_code in (400, 413, 422):
            raise Refused(_error_message(resp))
        if resp.status_code >= 400:
            raise ControlPlaneUnavailable(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")

    async def _post(self, path: str, message: BaseModel, answer: type[R]) -> R:
        resp = await self._send("POST", path, content=message.model_dump_json(),
                                headers={"Content-Type": "application/json"})
        try:
            return answer.model_validate_json(resp.content)
        except ValueError as exc:
            raise ControlPlaneUnavailable(f"{path}: unreadable answer: {exc}") from exc

    async def poll(self, ask: BoxPollRequest) -> BoxPollResponse:
        return await self._post("/poll", ask, BoxPollResponse)

    async def results(self, done: BoxResultsRequest) -> BoxResultsResponse:
        return await self._post("/results", done, BoxResultsResponse)

    async def output(self, ask: BoxOutputRequest) -> BoxOutputResponse:
        return await self._post("/output", ask, BoxOutputResponse)

    async def release(self, ask: BoxReleaseRequest) -> BoxReleaseResponse:
        return await self._post("/release", ask, BoxReleaseResponse)

    async def put_snapshot_part(self, box_id: str, epoch: int, upload_id: str, seq: int,
                                data: bytes) -> None:
        """One part of a snapshot on its way (SNAPSHOT_PART_BYTES at most); sending a part
        again replaces it."""
        await self._send("PUT", f"/{box_id}/snapshots/uploads/{upload_id}/parts/{seq}",
                         params={"epoch": epoch}, content=data,
                         headers={"Content-Type": "application/octet-stream"})

    async def commit_snapshot(self, box_id: str, epoch: int, kind: str, upload_id: str,
                              parts: int) -> SnapshotStored:
        """The upload's parts, 0 to parts - 1, become the box's latest snapshot."""
        resp = await self._send("POST", f"/{box_id}/snapshots",
                                params={"epoch": epoch, "kind": kind, "upload": upload_id,
                                        "parts": parts})
        return SnapshotStored.model_validate_json(resp.content)

    async def download_snapshot(self, box_id: str, snapshot_id: str, dest: Path) -> None:
        """Stream an archive into the file `dest`."""
        path = f"/{box_id}/snapshots/{snapshot_id}"
        try:
            async with self._client.stream("GET", path) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._check(path, resp)
                with open(dest, "wb") as out:
                    async for chunk in resp.aiter_bytes():
                        out.write(chunk)
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(f"{path}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self._client.aclose()
