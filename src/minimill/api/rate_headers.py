"""The x-ratelimit-* headers of a tenant's answers: what is left of its rate limits.

A route that admitted a request within the tenant's limits (control/rate_limits.py) leaves what
is left in the request's state; this middleware adds it to the answer's headers, whatever the
answer is (a JSON body, a stream of events). A 429 carries its own (api/errors.py).
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minimill.control.rate_limits import RateState

_STATE_KEY = "ratelimit_headers"


def remember(request: Request, state: RateState | None) -> None:
    if state is not None:
        setattr(request.state, _STATE_KEY, state.headers())


class RateHeadersMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                found = scope.get("state", {}).get(_STATE_KEY)
                if found:
                    message["headers"] = [*message.get("headers", []),
                                          *((k.encode(), v.encode()) for k, v in found.items())]
            await send(message)

        await self.app(scope, receive, with_headers)
