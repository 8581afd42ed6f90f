"""The x-ratelimit-* headers of a tenant's answers: what is left of its rate limits.

A route that admitted a request within the tenant's limits (control/rate_limits.py) leaves what
is left in the request's state; the answer-headers middleware (request_ids.py) adds it to the
answer's headers, whatever the answer is (a JSON body, a stream of events). A 429 carries its
own (api/errors.py).
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import Scope

from minimill.control.rate_limits import RateState

_STATE_KEY = "ratelimit_headers"


def remember(request: Request, state: RateState | None) -> None:
    if state is not None:
        setattr(request.state, _STATE_KEY, state.headers())


def headers_of(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The headers `remember` left for this request's answer (none: the route admitted
    nothing against a limit)."""
    found = scope.get("state", {}).get(_STATE_KEY) or {}
    return [(k.encode(), v.encode()) for k, v in found.items()]
