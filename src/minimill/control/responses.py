"""Responses: create one (a request row of kind `response`, continuing a stored response when
asked), read it, cancel it, delete it, list its input items.

A response is an ordinary request row: it runs through the same queue, leases, checkpoints,
placement and metering as a chat request. Everything is tenant-scoped: another tenant's
response, like one created with `store: false` or a batch line, is not found (404).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, delete, insert, select

from minimill.control import checkpoints, rate_limits
from minimill.control.config import ControlConfig
from minimill.control.errors import ConflictError, InvalidRequestError, NotFoundError
from minimill.control.rate_limits import RateState
from minimill.control.records import Kind, RequestRecord, RequestStatus, Tier, new_id
from minimill.control.requests import (
    admission_tokens,
    cancel_request,
    record,
    record_with_checkpoint,
    row_values,
)
from minimill.control.response_bodies import (
    Continuation,
    ResponseBody,
    conversation,
    prepare_response,
)
from minimill.control.response_output import answer_message
from minimill.control.response_render import (
    output_of,
    render_input_items,
    request_id_of,
    response_id,
    spec,
    status_of,
    stored,
)
from minimill.control.store import Store
from minimill.control.tables import requests
from minimill.control.tenant_limits import TenantLimits
from minimill.control.webhook_events import unwatch, watch


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")


def _find(conn: Connection, tenant_id: str, response_id: str) -> RequestRecord | None:
    request_id = request_id_of(response_id)
    if request_id is None:
        return None
    row = conn.execute(select(requests).where(
        requests.c.id == request_id, requests.c.tenant_id == tenant_id,
        requests.c.kind == Kind.RESPONSE.value)).first()
    found = record_with_checkpoint(conn, row) if row is not None else None
    return found if found is not None and stored(found) else None


def _continuation(conn: Connection, tenant_id: str, previous_id: str) -> Continuation:
    previous = _find(conn, tenant_id, previous_id)
    if previous is None:
        raise NotFoundError(f"Previous response with id '{previous_id}' not found.",
                            param="previous_response_id", code="previous_response_not_found")
    if previous.status != RequestStatus.SUCCEEDED:
        raise InvalidRequestError(
            f"Previous response with id '{previous_id}' is {status_of(previous)}: only a "
            "completed (or incomplete) response can be continued.",
            param="previous_response_id")
    return Continuation(conversation=conversation(previous.body or {}),
                        answer=answer_message(previous.id, output_of(previous)),
                        session_key=previous.session_key)


def create_response(store: Store, tenant_id: str, parsed: ResponseBody, config: ControlConfig,
                    now: float) -> RequestRecord:
    """Queue a response; a background one is watched for its webhook event."""
    return create_response_limited(store, tenant_id, parsed, config, now)[0]


def create_response_limited(store: Store, tenant_id: str, parsed: ResponseBody,
                            config: ControlConfig, now: float,
                            limits: TenantLimits | None = None
                            ) -> tuple[RequestRecord, RateState | None]:
    """Queue a response, within the tenant's `limits` (rate_limits.py); a background one is
    watched for its webhook event. Returns it, and what is left of the limits."""
    request_id = new_id("req_")
    background = bool(parsed.background)
    with store.write() as conn:
        previous = (_continuation(conn, tenant_id, parsed.previous_response_id)
                    if parsed.previous_response_id is not None else None)
        prepared = prepare_response(parsed, config.served_models, previous=previous,
                                    session_key=response_id(request_id),
                                    context_lengths=config.context_length_of)
        window = config.background_response_window_s if background \
            else config.realtime_timeout_s
        values = row_values(tenant_id, prepared, now, now + window, prepared.tier,
                            id=request_id)
        state = None if limits is None else rate_limits.admit(
            conn, tenant_id, admission_tokens(values), now, limits,
            realtime=prepared.tier == Tier.REALTIME and not background)
        conn.execute(insert(requests).values(**values))
        if background:
            watch(conn, "response", request_id, tenant_id, now)
        row = conn.execute(select(requests).where(requests.c.id == request_id)).one()
    return record(row), state


def get_response(store: Store, tenant_id: str, response_id: str) -> RequestRecord:
    with store.read() as conn:
        found = _find(conn, tenant_id, response_id)
    if found is None:
        raise _not_found(response_id)
    return found


def cancel_response(store: Store, tenant_id: str, response_id: str,
                    now: float) -> RequestRecord:
    """Cancel a background response that is queued or running (its lease is revoked)."""
    found = get_response(store, tenant_id, response_id)
    if not spec(found).get("background"):
        raise InvalidRequestError("Only responses created with background: true can be "
                                  "cancelled.", param="response_id")
    if not found.terminal:
        cancel_request(store, found.id, now, "the response was cancelled")
        found = get_response(store, tenant_id, response_id)
    if found.status != RequestStatus.CANCELLED:
        raise ConflictError(f"Cannot cancel a response with status '{status_of(found)}'.",
                            param="response_id")
    return found


def delete_response(store: Store, tenant_id: str, response_id: str) -> None:
    """Delete a stored response; one still running stops (its worker's lease is revoked, as
    the row is gone) and sends no webhook event."""
    with store.write() as conn:
        found = _find(conn, tenant_id, response_id)
        if found is None:
            raise _not_found(response_id)
        conn.execute(delete(requests).where(requests.c.id == found.id))
        checkpoints.drop(conn, [found.id])  # a running one's text so far goes too
        unwatch(conn, found.id)


def list_input_items(store: Store, tenant_id: str, response_id: str, *, after: str | None,
                     limit: int, order: str) -> tuple[list[dict[str, Any]], bool]:
    """A page of the response's input items, in `order` ("asc" or "desc", OpenAI's default);
    `after` is the id of the last item of the previous page."""
    items = render_input_items(get_response(store, tenant_id, response_id))
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise NotFoundError(f"No input item with id '{after}' in response "
                                f"'{response_id}'.", param="after")
        items = items[ids.index(after) + 1:]
    return items[:limit], len(items) > limit
