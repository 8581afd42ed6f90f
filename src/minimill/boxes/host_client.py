"""A box host's HTTP client for the control plane's `/v1/fleet/boxes` routes.

Network trouble raises ControlPlaneUnavailable (the caller retries with backoff:
`fleet.client.retrying`);
a 401/403 raises SiteAuthError; a 404/409 (a snapshot upload, streamed output) means the box
or the operation is no longer this host's, except an incremental snapshot's 409 saying that
its parent is gone (ParentMissing).
"""

from __future__ import annotations

from typing import TypeVar

import httpx
from pydantic import BaseModel

from minimill.box_protocol import (
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
from minimill.fleet.client import (
    ControlPlaneUnavailable,
    SiteAuthError,
)

R = TypeVar("R", bound=BaseModel)


class NotHeld(RuntimeError):
    """The control plane says the box is not this host's at that epoch any more."""


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
        if resp.status_code in (401, 403):
            raise SiteAuthError(f"the control plane rejected this site's token "
                                f"(HTTP {resp.status_code}): {resp.text[:300]}")
        if resp.status_code == 409 and _error_code(resp) == SNAPSHOT_PARENT_NOT_FOUND:
            raise ParentMissing(f"{path}: {resp.text[:300]}")
        if resp.status_code in (404, 409):
            raise NotHeld(f"{path}: {resp.text[:300]}")
        if resp.status_code >= 400:
            raise ControlPlaneUnavailable(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp

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

    async def upload_snapshot(self, box_id: str, epoch: int, kind: str,
                              archive: bytes) -> SnapshotStored:
        resp = await self._send("POST", f"/{box_id}/snapshots",
                                params={"epoch": epoch, "kind": kind}, content=archive,
                                headers={"Content-Type": "application/octet-stream"})
        return SnapshotStored.model_validate_json(resp.content)

    async def download_snapshot(self, box_id: str, snapshot_id: str) -> bytes:
        resp = await self._send("GET", f"/{box_id}/snapshots/{snapshot_id}")
        return resp.content

    async def close(self) -> None:
        await self._client.aclose()
