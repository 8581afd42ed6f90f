"""A response's output items: its answer's text parsed into a message and function calls, in
the order the model wrote them. Pure.

A response with tools gets its answer back as raw text in its model's tool syntax (the choice's
`tool_format`); the text is parsed with the same incremental parser chat streams use. The
parse gives the items (the message, where there is text outside calls, and one item per call,
numbered by first appearance) and the segments the text came in: runs of one item's text (the
message's words or a call's arguments) in the order they were written. Both grow only at the
end as the text grows, which is what lets response_render.py number stream events once and for
all. The message item is one item even when text comes both before and after calls. A call cut
short (by max_output_tokens) stays an unclosed item, shown as incomplete; the grammar the engine
enforces makes every other call well formed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

from minimill.control.render import request_hex, tool_call_id
from minimill.models.tool_calls import (
    FORMATS,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ToolCallParser,
)


@dataclass(slots=True)
class OutputItem:
    kind: Literal["message", "function_call"]
    index: int  # its output_index
    text: str = ""  # the message's text, or the call's arguments (JSON text) so far
    name: str = ""  # a call's function
    call: int = 0  # a call's place among the answer's calls (its ids derive from it)
    closed: bool = False  # a call whose JSON is complete: its arguments are final


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of one item's text, as written."""

    item: int  # the item's output_index
    text: str


@dataclass(slots=True)
class ParsedOutput:
    items: list[OutputItem] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    def extend(self, index: int, text: str) -> None:
        last = self.segments[-1] if self.segments else None
        if last is not None and last.item == index:
            self.segments[-1] = Segment(index, last.text + text)
        else:
            self.segments.append(Segment(index, text))
        self.items[index].text += text

    @property
    def message(self) -> OutputItem | None:
        return next((i for i in self.items if i.kind == "message"), None)

    @property
    def calls(self) -> list[OutputItem]:
        return [i for i in self.items if i.kind == "function_call"]


def parse_output(text: str, tool_format: str | None, *, final: bool) -> ParsedOutput:
    """The items and segments of an answer's `text` so far (`final`: the whole answer)."""
    out = ParsedOutput()
    fmt = FORMATS.get(str(tool_format)) if tool_format else None
    if fmt is None:
        if text:
            out.items.append(OutputItem("message", 0))
            out.extend(0, text)
        return out
    parser = ToolCallParser(fmt)
    events = parser.feed(text)
    if final:
        events += parser.finish()
    message: OutputItem | None = None
    calls: dict[int, OutputItem] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            if message is None:
                message = OutputItem("message", len(out.items))
                out.items.append(message)
            out.extend(message.index, event.text)
        elif isinstance(event, CallStarted):
            item = calls[event.index] = OutputItem("function_call", len(out.items),
                                                   name=event.name, call=event.index)
            out.items.append(item)
            out.extend(item.index, "")  # the call shows from its name on
        elif isinstance(event, ArgumentsDelta) and event.index in calls:
            out.extend(calls[event.index].index, event.text)
    for i in range(len(parser.calls)):
        if i in calls:
            calls[i].closed = True
    return out


def message_id(request_id: str) -> str:
    return "msg_" + request_hex(request_id)


def call_item_id(request_id: str, call: int) -> str:
    """A function_call item's id: the same in a stream, the response and later reads."""
    digest = hashlib.blake2b(f"{request_id}:fc:{call}".encode(), digest_size=12).hexdigest()
    return f"fc_{digest}"


def output_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def render_item(request_id: str, item: OutputItem, status: str, *,
                empty: bool = False) -> dict[str, Any]:
    """An output item in OpenAI's shape (`empty`: as first announced, before its text)."""
    text = "" if empty else item.text
    if item.kind == "message":
        shown = not empty and (bool(text) or status != "in_progress")
        return {"id": message_id(request_id), "type": "message", "role": "assistant",
                "status": status, "content": [output_part(text)] if shown else []}
    return {"id": call_item_id(request_id, item.call), "type": "function_call",
            "call_id": tool_call_id(request_id, 0, item.call), "name": item.name,
            "arguments": text, "status": status}


def answer_message(request_id: str, out: ParsedOutput) -> dict[str, Any]:
    """A finished answer as the assistant chat message a later response continues after:
    its text, and its complete calls (an answer cut inside a call made no call)."""
    message = out.message
    calls = [{"id": tool_call_id(request_id, 0, c.call), "type": "function",
              "function": {"name": c.name, "arguments": c.text}}
             for c in out.calls if c.closed]
    if not calls:
        return {"role": "assistant", "content": message.text if message else ""}
    return {"role": "assistant", "content": message.text if message else None,
            "tool_calls": calls}
