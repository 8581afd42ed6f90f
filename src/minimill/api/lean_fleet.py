"""The lean path of the four calls a token site makes in its loop: lease, heartbeat (with its
checkpoints), complete and release, answered before FastAPI's routing and dependency solving,
which cost these calls more CPU than their store work.

A plain ASGI middleware, the innermost of the app's own (app.py): the request ids, the HTTP
metrics (labelled with the route's template, as FastAPI's route would be) and the body-size
limit wrap it as they wrap the routes; the tenants' rate limits do not apply to sites. It
answers a `POST` to exactly one of the four paths whose `Authorization` is `Bearer <site
token>` and whose body is JSON (`Content-Type: application/json`) that the route's request
model accepts: the body is read whole and parsed by one cached TypeAdapter per route, the call
does the route's own work (token_calls.py: the token checked on the thread of the store work,
nothing cached, so a replaced token or withdrawn scope is refused at once), and the answer is
serialized as FastAPI serializes the route's `response_model`. A domain error is answered by
the same renderer as the routes' (errors.py). Anything else (no or another credential, another
content type, a body the model refuses) goes on to FastAPI with the body already read, whose
route gives the one definition of those answers: byte for byte what the call would have got
without this path (tests/api/test_lean_fleet.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minimill.api import token_calls
from minimill.api.deps import TokenFleetCall, token_fleet_call
from minimill.api.errors import control_error_response
from minimill.api.routes import fleet
from minimill.control.errors import ControlError
from minimill.control.sites import TOKEN_PREFIX as SITE_TOKEN_PREFIX
from minimill.transport.protocol import (
    FLEET_PREFIX,
    CompleteRequest,
    CompleteResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    LeaseRequest,
    LeaseResponse,
    ReleaseRequest,
    ReleaseResponse,
)

Work = Callable[[TokenFleetCall, Any, Receive], Awaitable[BaseModel]]


@dataclass(frozen=True, slots=True)
class LeanRoute:
    """One call the lean path answers: how its body is parsed, its work, how its answer is
    written (FastAPI's `response_model` and `response_model_exclude_none` of the route)."""

    ask: TypeAdapter[Any]
    work: Work
    answer: TypeAdapter[Any]
    exclude_none: bool = False


LEAN_ROUTES: dict[str, LeanRoute] = {
    FLEET_PREFIX + "/lease": LeanRoute(
        TypeAdapter(LeaseRequest), lambda f, ask, receive: token_calls.lease(f, ask, receive),
        TypeAdapter(LeaseResponse)),
    FLEET_PREFIX + "/heartbeat": LeanRoute(
        TypeAdapter(HeartbeatRequest), lambda f, beat, _r: token_calls.heartbeat(f, beat),
        TypeAdapter(HeartbeatResponse)),
    FLEET_PREFIX + "/complete": LeanRoute(
        TypeAdapter(CompleteRequest), lambda f, done, _r: token_calls.complete(f, done),
        TypeAdapter(CompleteResponse), exclude_none=True),
    FLEET_PREFIX + "/release": LeanRoute(
        TypeAdapter(ReleaseRequest), lambda f, ask, _r: token_calls.release_leases(f, ask),
        TypeAdapter(ReleaseResponse)),
}

# The FastAPI routes of these paths: a call is labelled with its route's template in the
# metrics (metrics.py reads it from the scope, where FastAPI's routing leaves the route).
API_ROUTES: dict[str, APIRoute] = {r.path: r for r in fleet.router.routes
                                   if isinstance(r, APIRoute) and r.path in LEAN_ROUTES}


def site_token_of(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The bearer token of the call, when it is shaped as a site token; None for anything the
    routes' dependency would refuse or read otherwise (FastAPI's HTTPBearer reads the first
    `Authorization` header: `<scheme> <credentials>`, the scheme in any case)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, credentials = value.decode("latin-1").partition(" ")
            credentials = credentials.strip()
            if scheme.lower() == "bearer" and credentials.startswith(SITE_TOKEN_PREFIX):
                return credentials
            return None
    return None


def is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether FastAPI would read the body as JSON and nothing else (its other JSON types,
    `+json` ones, go on to it)."""
    for name, value in headers:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


async def read_body(receive: Receive) -> tuple[bytes, list[Message]]:
    """The whole body, and the messages it came in (to hand them on as they came). A body
    over the limit raises from `receive` (limits.py counts it), and the body-size middleware
    answers 413 as it does for the routes. A client gone before its body ended leaves the
    disconnect last."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    return b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request"), \
        messages


def parsed(route: LeanRoute, body: bytes) -> Any | None:
    """The call's request model, or None for a body the model refuses."""
    try:
        return route.ask.validate_json(body)
    except ValidationError:
        return None


def replayed(messages: list[Message], receive: Receive) -> Receive:
    """`receive` with the messages already read handed over once again first."""
    pending = list(messages)

    async def receive_again() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return receive_again


class LeanFleetPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (LEAN_ROUTES.get(scope["path"])
                 if scope["type"] == "http" and scope["method"] == "POST" else None)
        token = site_token_of(scope["headers"]) if route is not None else None
        if route is None or token is None or not is_json(scope["headers"]):
            await self.app(scope, receive, send)
            return
        body, messages = await read_body(receive)
        ask = parsed(route, body) if messages[-1]["type"] == "http.request" else None
        if ask is None:  # FastAPI's route says what is wrong, as it would have
            await self.app(scope, replayed(messages, receive), send)
            return
        app: FastAPI = scope["app"]
        scope["route"] = API_ROUTES[scope["path"]]  # what FastAPI's routing would leave
        try:
            answer = await route.work(token_fleet_call(app, token), ask, receive)
        except ControlError as exc:
            await control_error_response(exc)(scope, receive, send)
            return
        content = route.answer.dump_json(answer, by_alias=True, exclude_none=route.exclude_none)
        await Response(content, media_type="application/json")(scope, receive, send)
