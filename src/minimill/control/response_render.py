"""OpenAI Response objects and their stream events, built from a stored request row. Pure.

A stream is a pure function of the row: `response_events(row)` lists every event the row's
state implies, numbered from 0, and the list for a later state extends the list for an earlier
one. So any process can stream a response, and a client that reconnects with `starting_after`
gets exactly the events after that number: no gap, no repeat, nothing kept outside the store.
That holds because the text only grows (a resumed request continues its checkpoint's text), its
output items (the message and function calls, response_output.py) grow only at the end with it,
and deltas are cut by a rule of the text alone: a piece is a run of whitespace and up to 32
non-space characters, sent once the text goes on past it (or the item or response has ended).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from minimill.control.records import RequestRecord, RequestStatus
from minimill.control.render import request_hex, service_tier
from minimill.control.response_output import (
    OutputItem,
    ParsedOutput,
    call_item_id,
    message_id,
    output_part,
    parse_output,
    render_item,
)

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


def output_of(record: RequestRecord) -> ParsedOutput:
    """The response's output items so far (all of them once it has ended); a response that
    succeeded without a word or a call still has its (empty) message."""
    choice = _choice(record)
    out = parse_output(str(choice.get("text") or ""), choice.get("tool_format"),
                       final=record.terminal)
    if not out.items and record.status == RequestStatus.SUCCEEDED:
        out.items.append(OutputItem("message", 0))
        out.extend(0, "")
    return out


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


def _item_status(record: RequestRecord, item: OutputItem) -> str:
    """A call is complete once its JSON is; the message once the response is."""
    if item.closed:
        return "completed"
    if not record.terminal:
        return "in_progress"
    if item.kind == "function_call":
        return "incomplete"  # cut inside the call
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
    output = ([render_item(record.id, item, _item_status(record, item))
               for item in output_of(record).items] if with_output else [])
    final = with_output and record.terminal
    incomplete = {"reason": "max_output_tokens"} if final and status == "incomplete" else None
    return {
        "id": response_id(record.id), "object": "response", "created_at": int(record.created_at),
        "status": status, "background": bool(s.get("background")),
        "error": _error(record) if final else None, "incomplete_details": incomplete,
        "instructions": s.get("instructions"), "max_output_tokens": s.get("max_output_tokens"),
        "metadata": s.get("metadata") or {}, "model": record.model or "", "output": output,
        "parallel_tool_calls": s.get("parallel_tool_calls", True),
        "previous_response_id": s.get("previous_response_id"),
        "prompt_cache_key": s.get("prompt_cache_key"),
        "safety_identifier": s.get("safety_identifier"),
        "service_tier": service_tier(record.tier), "store": s.get("store", True) is not False,
        "temperature": s.get("temperature") if s.get("temperature") is not None else 1.0,
        "text": {"format": s.get("text_format") or {"type": "text"},
                 "verbosity": s.get("verbosity") or "medium"},
        "tool_choice": s.get("tool_choice") or "auto", "tools": s.get("tools") or [],
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
    (numbered from 0); earlier ones are counted, not built, so a long stream stays cheap.

    Items are announced in the order the model started them and their text is sent segment
    by segment (response_output.py); a call is done as soon as its JSON is complete, the
    message (which may go on after calls) once the response has ended."""
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
    out = output_of(record)
    rid = record.id
    added: set[int] = set()
    done: set[int] = set()

    def message_where(item: OutputItem) -> dict[str, Any]:
        return {"item_id": message_id(rid), "output_index": item.index, "content_index": 0}

    def call_where(item: OutputItem) -> dict[str, Any]:
        return {"item_id": call_item_id(rid, item.call), "output_index": item.index}

    def announce(item: OutputItem) -> None:
        added.add(item.index)
        emit("response.output_item.added", lambda: {
            "output_index": item.index,
            "item": render_item(rid, item, "in_progress", empty=True)})
        if item.kind == "message":
            emit("response.content_part.added", lambda: {**message_where(item),
                                                         "part": output_part("")})

    def finish(item: OutputItem) -> None:
        done.add(item.index)
        status = _item_status(record, item)
        if item.kind == "message":
            where = message_where(item)
            emit("response.output_text.done", lambda: {**where, "text": item.text,
                                                       "logprobs": []})
            emit("response.content_part.done", lambda: {**where,
                                                        "part": output_part(item.text)})
        elif status == "completed":
            emit("response.function_call_arguments.done", lambda: {
                **call_where(item), "name": item.name, "arguments": item.text})
        emit("response.output_item.done", lambda: {
            "output_index": item.index, "item": render_item(rid, item, status)})

    for n, segment in enumerate(out.segments):
        item = out.items[segment.item]
        if item.index not in added:
            announce(item)
        # A segment's last piece may still grow until the text has gone on past it.
        whole = n < len(out.segments) - 1 or record.terminal or item.closed
        kind, where = (("response.output_text.delta", {**message_where(item), "logprobs": []})
                       if item.kind == "message"
                       else ("response.function_call_arguments.delta", call_where(item)))
        for piece in _pieces(segment.text, whole):
            emit(kind, functools.partial(dict, where, delta=piece))
        if item.closed:
            finish(item)
    if not record.terminal:
        return events
    for item in out.items:
        if item.index not in done:
            finish(item)
    final = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
        status_of(record), "response.failed")  # no stream event says "cancelled": its status does
    emit(final, lambda: {"response": render_response(record)})
    return events


def render_input_items(record: RequestRecord) -> list[dict[str, Any]]:
    """The response's input items, oldest first."""
    return list(spec(record).get("input") or [])
