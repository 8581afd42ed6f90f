"""The worker's HTTP client for the control plane's fleet routes (protocol.py), with retries.

Network trouble (refused, reset, timeouts, 5xx, 429) is retried with capped exponential backoff
and jitter: a site that is cut off keeps generating and keeps its unsent results. A 401/403
means the site token is wrong: that is final and raised as `SiteAuthError`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
from pydantic import BaseModel

from minimill.transport.protocol import (
    FLEET_PREFIX,
    LEASE_CALL_TIMEOUT_S,
    CompleteRequest,
    CompleteResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    LeaseRequest,
    LeaseResponse,
    ReleaseRequest,
    ReleaseResponse,
)

log = logging.getLogger("minimill.worker")
R = TypeVar("R", bound=BaseModel)
T = TypeVar("T")
# How long a leaving site keeps trying to deliver what it still holds (final checkpoints,
# hand-backs, results) before it gives up and lets the leases expire.
FINAL_SEND_S = 5.0


class SiteAuthError(RuntimeError):
    """The control plane rejected the site token (HTTP 401/403)."""


class ControlPlaneUnavailable(RuntimeError):
    """One call failed for a passing reason; the caller decides when to try again. `status`:
    the HTTP status of the control plane's answer (None: no answer came)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class PayloadTooLarge(ControlPlaneUnavailable):
    """The control plane refused the request's size (413): sending it again will not help."""


class Backoff:
    """Capped exponential backoff with full jitter; `reset` after a success."""

    def __init__(self, base_s: float = 0.2, cap_s: float = 5.0) -> None:
        self.base_s, self.cap_s, self.failures = base_s, cap_s, 0

    def next_delay(self) -> float:
        self.failures += 1
        return random.uniform(0.5, 1.0) * min(self.cap_s, self.base_s * 2 ** (self.failures - 1))

    def reset(self) -> None:
        self.failures = 0


class ControlPlaneClient:
    """One call per method; each raises ControlPlaneUnavailable rather than retrying itself,
    so the worker's loops keep their own rhythm (heartbeats must not wait behind a lease call).
    """

    def __init__(self, server: str, token: str, timeout_s: float = 10.0) -> None:
        self._client = httpx.AsyncClient(
            base_url=server.rstrip("/") + FLEET_PREFIX,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=8))
        self._lease_timeout = httpx.Timeout(max(timeout_s, LEASE_CALL_TIMEOUT_S),
                                            connect=timeout_s)

    async def _post(self, path: str, message: BaseModel, response_type: type[R]) -> R:
        try:
            resp = await self._client.post(
                path, content=message.model_dump_json(),
                headers={"Content-Type": "application/json"},
                timeout=self._lease_timeout if path == "/lease" else httpx.USE_CLIENT_DEFAULT)
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(f"{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in (401, 403):
            raise SiteAuthError(f"the control plane rejected this site's token "
                                f"(HTTP {resp.status_code}): {resp.text[:300]}")
        if resp.status_code == 413:
            raise PayloadTooLarge(f"{path}: HTTP 413: {resp.text[:300]}")
        if resp.status_code >= 400:
            raise ControlPlaneUnavailable(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}",
                                          resp.status_code)
        try:
            return response_type.model_validate_json(resp.content)
        except ValueError as exc:
            raise ControlPlaneUnavailable(f"{path}: unreadable answer: {exc}") from exc

    async def lease(self, request: LeaseRequest) -> LeaseResponse:
        return await self._post("/lease", request, LeaseResponse)

    async def heartbeat(self, request: HeartbeatRequest) -> HeartbeatResponse:
        return await self._post("/heartbeat", request, HeartbeatResponse)

    async def complete(self, request: CompleteRequest) -> CompleteResponse:
        return await self._post("/complete", request, CompleteResponse)

    async def release(self, request: ReleaseRequest) -> ReleaseResponse:
        return await self._post("/release", request, ReleaseResponse)

    async def close(self) -> None:
        await self._client.aclose()


async def sleep_backoff(backoff: Backoff, what: str, exc: Exception) -> None:
    delay = backoff.next_delay()
    if backoff.failures in (1, 5) or backoff.failures % 20 == 0:
        log.warning("%s failed (%s); retrying in %.1fs", what, exc, delay)
    await asyncio.sleep(delay)


async def retrying(call: Callable[[], Awaitable[T]], what: str) -> T:
    """Call until the control plane answers, backing off between tries; any error other than
    ControlPlaneUnavailable (an auth error, a lost lease) goes to the caller."""
    backoff = Backoff()
    while True:
        try:
            return await call()
        except ControlPlaneUnavailable as exc:
            await sleep_backoff(backoff, what, exc)


async def send_within(send: Callable[[], Awaitable[None]], what: str,
                      limit_s: float = FINAL_SEND_S) -> None:
    """`send`, tried again every half second until it succeeds or `limit_s` is over."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            await asyncio.wait_for(send(), max(deadline - time.monotonic(), 0.01))
            return
        except (ControlPlaneUnavailable, TimeoutError) as exc:
            left = deadline - time.monotonic()
            if left <= 0.1:
                log.warning("%s not delivered: %s", what, exc)
                return
            await asyncio.sleep(min(0.5, left))
