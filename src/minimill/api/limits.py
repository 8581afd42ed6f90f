"""413 for oversized uploads before the multipart parser spools them anywhere.

A declared Content-Length over the limit is refused at once; a body without one is counted as
it arrives and refused as soon as it passes the limit (whatever the app was about to answer).
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Multipart framing around the file (boundaries, part headers, the purpose field).
MULTIPART_SLACK_BYTES = 64 * 1024


class _TooLarge(Exception):
    pass


class UploadLimitMiddleware:
    def __init__(self, app: ASGIApp, max_file_bytes: int, path: str = "/v1/files") -> None:
        self.app = app
        self.limit = max_file_bytes + MULTIPART_SLACK_BYTES
        self.max_file_bytes = max_file_bytes
        self.path = path

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"error": {
            "message": f"The upload is larger than the limit of {self.max_file_bytes} bytes.",
            "type": "invalid_request_error", "param": "file", "code": "file_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"].rstrip("/") != self.path):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(send)
                return
        received = 0
        exceeded = started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
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
            await self._refuse(send)
