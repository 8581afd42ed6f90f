"""413 for request bodies over their route's limit, before anything parses or spools them.

Uploads (`POST /v1/files`) may carry a whole file; the worker protocol's routes whole results;
every other route one OpenAI request body. A declared Content-Length over the limit is refused
at once; a body without one is counted as it arrives and refused as soon as it passes the limit
(whatever the app was about to answer). The answer is an OpenAI error object.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minimill.transport.protocol import FLEET_PREFIX

# Multipart framing around the file (boundaries, part headers, the purpose field).
MULTIPART_SLACK_BYTES = 64 * 1024
UPLOAD_PATH = "/v1/files"


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_file_bytes: int,
                 max_fleet_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_file_bytes = max_file_bytes
        self.max_fleet_body_bytes = max_fleet_body_bytes

    def _limit(self, scope: Scope) -> tuple[int, dict[str, Any]]:
        """The route's limit in bytes, and the error that says it was passed."""
        path = scope["path"].rstrip("/")
        if scope["method"] == "POST" and path == UPLOAD_PATH:
            return self.max_file_bytes + MULTIPART_SLACK_BYTES, {
                "message": f"The upload is larger than the limit of {self.max_file_bytes} "
                           "bytes.",
                "type": "invalid_request_error", "param": "file", "code": "file_too_large"}
        limit = (self.max_fleet_body_bytes if path.startswith(FLEET_PREFIX + "/")
                 else self.max_body_bytes)
        return limit, {"message": f"The request body is larger than the limit of {limit} "
                                  "bytes.",
                       "type": "invalid_request_error", "param": None,
                       "code": "request_too_large"}

    @staticmethod
    async def _refuse(send: Send, error: dict[str, Any]) -> None:
        body = json.dumps({"error": error}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, error = self._limit(scope)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._refuse(send, error)
                return
        received = 0
        exceeded = started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise _TooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:
                return  # the app's answer to a truncated body is replaced by the 413
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded and not started:
            await self._refuse(send, error)
