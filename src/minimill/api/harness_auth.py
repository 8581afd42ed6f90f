"""What a harness credential (control/harness_keys.py) reaches on the tenant API: its model
calls, the box its agent created, and its agent's journal; nothing else (403 naming why).

A runner site holds the credential while it runs the agent: if the site is hostile, this is
all it can do with it, for as long as it holds the lease. An Idempotency-Key (which finds an
earlier call's result) must be the agent's own (`AGENT_ID/...`, as the runner sends them), so
that one agent's credential cannot read another agent's results through it.
"""

from __future__ import annotations

import time
from typing import Literal

from fastapi import Request

from minimill.control import harness_keys
from minimill.control.errors import PermissionDeniedError
from minimill.control.harness_keys import Harness
from minimill.control.store import Store

Reach = Literal["model", "new_box", "box", "agent"]
# (method, route template) -> what the route touches.
HARNESS_ROUTES: dict[tuple[str, str], Reach] = {
    ("POST", "/v1/chat/completions"): "model",
    ("POST", "/v1/completions"): "model",
    ("POST", "/v1/boxes"): "new_box",
    ("GET", "/v1/boxes/{box_id}"): "box",
    ("POST", "/v1/boxes/{box_id}/exec"): "box",
    ("PUT", "/v1/boxes/{box_id}/files"): "box",
    ("GET", "/v1/boxes/{box_id}/files/content"): "box",
    ("GET", "/v1/agents/{agent_id}/journal"): "agent",
}


def _refuse(message: str) -> PermissionDeniedError:
    return PermissionDeniedError(f"A harness credential reaches only its agent's model calls, "
                                 f"box and journal: {message}", code="harness_scope")


def admit(request: Request, store: Store, harness: Harness) -> None:
    """Let a harness credential through to this route, or raise 403 saying why not."""
    path = getattr(request.scope.get("route"), "path", request.url.path)
    reach = HARNESS_ROUTES.get((request.method, path))
    if reach is None:
        raise _refuse(f"not {request.method} {path}.")
    once = request.headers.get("idempotency-key")
    if once is not None and not once.startswith(harness.agent_id + "/"):
        raise _refuse("an Idempotency-Key must start with the agent's id and '/'.")
    if reach == "box" and not harness_keys.owns_box(store, harness.agent_id,
                                                    request.path_params.get("box_id", "")):
        raise _refuse("this box is not one its agent created.")
    if reach == "agent" and request.path_params.get("agent_id") != harness.agent_id:
        raise _refuse("this is another agent.")
    if reach == "new_box":
        if harness_keys.boxes_of(store, harness.agent_id) >= harness_keys.MAX_BOXES_PER_AGENT:
            raise _refuse(f"its agent has {harness_keys.MAX_BOXES_PER_AGENT} boxes already.")
        request.state.harness = harness


def check_new_box(request: Request, image: str | None, snapshot: str | None) -> None:
    """A harness's box starts from its agent's image (or empty), never from another archive of
    the tenant's (a snapshot of some other box, say)."""
    harness: Harness | None = getattr(request.state, "harness", None)
    if harness is not None and (snapshot is not None or image != harness.box_image):
        raise _refuse("its box starts from the agent's own image.")


def record_new_box(request: Request, store: Store, box_id: str) -> None:
    """The box a harness just created is its agent's (the only boxes its credential reaches)."""
    harness: Harness | None = getattr(request.state, "harness", None)
    if harness is not None:
        harness_keys.bind_box(store, harness.agent_id, box_id, time.time())
