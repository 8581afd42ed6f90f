"""OpenAI Response objects and their stream events, built from a stored request row. Pure.

A stream is a pure function of the row: `response_events(row)` lists every event the row's
state implies, numbered from 0, and the list for a later state extends the list for an earlier
one. So any process can stream a response, and a client that reconnects with `starting_after`
gets exactly the events after that number: no gap, no repeat, nothing kept outside the store.
That holds because the text only grows (a resumed request continues its checkpoint's text) and
deltas are cut by a rule of the text alone: a piece is a run of whitespace and up to 32
non-space characters, sent once the text goes on past it (or the response has ended).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from minimill.control.records import RequestRecord, RequestStatus
from minimill.control.render import request_hex, service_tier

RESPONSE_PREFIX = "resp_"
_PIECE = re.compile(r"\s*\S{1,32}|\s+")
_STATUS = {RequestStatus.QUEUED: "queued", RequestStatus.LEASED: "in_progress",
           RequestStatus.FAILED: "failed", RequestStatus.EXPIRED: "failed",
           RequestStatus.CANCELLED: "cancelled"}


def response_id(request_id: str) -> str:
    return RESPONSE_PREFIX + request_hex(request_id)


def request_id_of(response_id: str) -> str | None:
    """The request row behind a response id; None when it is not one."""
    if not response_id.startswith(RESPONSE_PREFIX) or len(response_id) > 100:
        return None
    return "req_" + response_id.removeprefix(RESPONSE_PREFIX)


def message_id(request_id: str) -> str:
    return "msg_" + request_hex(request_id)


def spec(record: RequestRecord) -> dict[str, Any]:
    """The Responses parameters stored with the row (response_bodies.prepare_response)."""
    return dict((record.body or {}).get("response") or {})


def stored(record: RequestRecord) -> bool:
    """Whether the response may be read back (store: false, and batch lines, may not)."""
    return record.batch_id is None and spec(record).get("store", True) is not False


def _choice(record: RequestRecord) -> dict[str, Any]:
    source = record.result if record.status == RequestStatus.SUCCEEDED else record.checkpoint
    choices = (source or {}).get("choices") or []
    return next((c for c in choices if int(c.get("index", 0)) == 0), {})


def output_text(record: RequestRecord) -> str:
    """The answer so far (all of it once the response has succeeded)."""
    return str(_choice(record).get("text") or "")


def status_of(record: RequestRecord) -> str:
    if record.status == RequestStatus.SUCCEEDED:
        return "incomplete" if _choice(record).get("finish_reason") == "length" else "completed"
    return _STATUS[record.status]


def usage(record: RequestRecord) -> dict[str, Any] | None:
    """OpenAI's Responses usage plus `cost_usd`, what the tenant is billed (prices.py)."""
    if record.status != RequestStatus.SUCCEEDED:
        return None
    return {"input_tokens": record.prompt_tokens,
            "input_tokens_details": {"cached_tokens": record.cached_tokens},
            "output_tokens": record.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": record.prompt_tokens + record.completion_tokens,
            "cost_usd": record.billed_usd}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(record: RequestRecord, text: str, status: str) -> dict[str, Any]:
    return {"id": message_id(record.id), "type": "message", "role": "assistant",
            "status": status, "content": [_part(text)] if status != "in_progress" or text
            else []}


def _item_status(record: RequestRecord) -> str:
    if not record.terminal:
        return "in_progress"
    return "completed" if status_of(record) == "completed" else "incomplete"


def _error(record: RequestRecord) -> dict[str, Any] | None:
    if record.status not in (RequestStatus.FAILED, RequestStatus.EXPIRED):
        return None
    error = record.error or {}
    return {"code": error.get("code") or "server_error",
            "message": str(error.get("message") or "the response failed")}


def render_response(record: RequestRecord, *, status: str | None = None,
                    with_output: bool = True) -> dict[str, Any]:
    """A `response` object; `status` and `with_output` give the early stream snapshots."""
    s = spec(record)
    status = status or status_of(record)
    text = output_text(record)
    output = ([_item(record, text, _item_status(record))]
              if with_output and (text or record.status == RequestStatus.SUCCEEDED) else [])
    final = with_output and record.terminal
    incomplete = {"reason": "max_output_tokens"} if final and status == "incomplete" else None
    return {
        "id": response_id(record.id), "object": "response", "created_at": int(record.created_at),
        "status": status, "background": bool(s.get("background")),
        "error": _error(record) if final else None, "incomplete_details": incomplete,
        "instructions": s.get("instructions"), "max_output_tokens": s.get("max_output_tokens"),
        "metadata": s.get("metadata") or {}, "model": record.model or "", "output": output,
        "parallel_tool_calls": True, "previous_response_id": s.get("previous_response_id"),
        "prompt_cache_key": s.get("prompt_cache_key"),
        "service_tier": service_tier(record.tier), "store": s.get("store", True) is not False,
        "temperature": s.get("temperature") if s.get("temperature") is not None else 1.0,
        "text": {"format": {"type": "text"}, "verbosity": s.get("verbosity") or "medium"},
        "tool_choice": "auto", "tools": [],
        "top_p": s.get("top_p") if s.get("top_p") is not None else 1.0,
        "truncation": s.get("truncation") or "disabled",
        "usage": usage(record) if final else None, "user": s.get("user"),
        "completed_at": (int(record.finished_at) if final and status == "completed"
                         and record.finished_at is not None else None),
    }


def _pieces(text: str, final: bool) -> list[str]:
    """The deltas the text is cut into; the last piece may still grow unless `final`."""
    pieces = _PIECE.findall(text)
    return pieces if final else pieces[:-1]


def response_events(record: RequestRecord, start: int = 0) -> list[dict[str, Any]]:
    """The stream events the row's state implies whose `sequence_number` is `start` or more
    (numbered from 0); earlier ones are counted, not built, so a long stream stays cheap."""
    events: list[dict[str, Any]] = []
    seq = 0

    def emit(kind: str, fields: Callable[[], dict[str, Any]]) -> None:
        nonlocal seq
        if seq >= start:
            events.append({"type": kind, "sequence_number": seq, **fields()})
        seq += 1

    background = bool(spec(record).get("background"))
    emit("response.created", lambda: {"response": render_response(
        record, status="queued" if background else "in_progress", with_output=False)})
    emit("response.in_progress", lambda: {"response": render_response(
        record, status="in_progress", with_output=False)})
    text = output_text(record)
    where = {"item_id": message_id(record.id), "output_index": 0, "content_index": 0}
    started = bool(text) or record.status == RequestStatus.SUCCEEDED
    if started:
        emit("response.output_item.added",
             lambda: {"output_index": 0, "item": _item(record, "", "in_progress")})
        emit("response.content_part.added", lambda: {**where, "part": _part("")})
        for piece in _pieces(text, record.terminal):
            emit("response.output_text.delta", functools.partial(
                dict, where, delta=piece, logprobs=[]))
    if not record.terminal:
        return events
    if started:
        emit("response.output_text.done", lambda: {**where, "text": text, "logprobs": []})
        emit("response.content_part.done", lambda: {**where, "part": _part(text)})
        emit("response.output_item.done", lambda: {
            "output_index": 0, "item": _item(record, text, _item_status(record))})
    final = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
        status_of(record), "response.failed")  # no stream event says "cancelled": its status does
    emit(final, lambda: {"response": render_response(record)})
    return events


def render_input_items(record: RequestRecord) -> list[dict[str, Any]]:
    """The response's input items, oldest first."""
    return list(spec(record).get("input") or [])
