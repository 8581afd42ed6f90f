"""Every answer carries `x-request-id` (as OpenAI's do, and the openai SDK reads it into its
errors' `request_id`): a failed call can be named in one line, and found in the server's log,
which records the id of each answer that is an error. The same middleware adds the
`x-ratelimit-*` headers a route left for the answer (rate_headers.py): one wrapper of every
answer, not two."""

from __future__ import annotations

import logging
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minimill.api.rate_headers import headers_of

HEADER = b"x-request-id"
log = logging.getLogger("minimill.api")


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


class RequestIds:
    """A plain ASGI middleware (not BaseHTTPMiddleware, which would wrap the receive channel:
    see metrics._Measure)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (HEADER, request_id.encode()), *headers_of(scope)]
                if int(message["status"]) >= 400:
                    log.info("%s %s answered %d (%s)", scope["method"], scope["path"],
                             message["status"], request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)
