"""Responses input items (messages, function calls and their outputs) and the chat messages
they become.

A `function_call` item is an assistant message's tool call (consecutive calls, and the text an
assistant message item said just before them, make one assistant message, as chat templates
expect); a `function_call_output` item is a `tool` message answering its call. As OpenAI
checks, every output answers a call made earlier in the conversation (this input, or the
output of the response it continues) and every call is answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from minimill.control.body_rules import FUNCTION_NAME, StrictBody, type_tag
from minimill.control.errors import InvalidRequestError
from minimill.control.records import new_id

ITEM_TYPES = ("message", "function_call", "function_call_output")
ID_LENGTH = 200


class InputPart(StrictBody):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(StrictBody):
    """A message item (OpenAI's EasyInputMessage or input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[InputPart] | str


class FunctionCallItem(StrictBody):
    """A call the model made (an earlier response's output item, sent back as input)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=ID_LENGTH)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(description="The call's arguments, as JSON text.")
    id: str | None = Field(None, min_length=1, max_length=ID_LENGTH)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class OutputTextPart(StrictBody):
    type: Literal["input_text"]
    text: str


class FunctionCallOutputItem(StrictBody):
    """What a call returned: a tool message for the model."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=ID_LENGTH)
    output: list[OutputTextPart] | str
    id: str | None = Field(None, min_length=1, max_length=ID_LENGTH)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = Annotated[Annotated[InputMessage, Tag("type=message")]
                      | Annotated[FunctionCallItem, Tag("type=function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("type=function_call_output")],
                      Discriminator(lambda v: type_tag(v, "message"))]


def refuse_unsupported_items(raw: dict[str, Any]) -> None:
    """Item types this server does not have (references, reasoning, hosted tools' calls),
    named by their path before field validation."""
    items = raw.get("input")
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in ITEM_TYPES:
            raise ValueError(f"input[{i}].type: {kind!r} items are not supported by this "
                             f"server; use {', '.join(ITEM_TYPES)}")


def stored_items(items: Sequence[InputMessage | FunctionCallItem | FunctionCallOutputItem]
                 ) -> list[dict[str, Any]]:
    """The input as OpenAI's input items (what `input_items` lists), each with an id."""
    out = []
    for item in items:
        if isinstance(item, InputMessage):
            part = "output_text" if item.role == "assistant" else "input_text"
            content = ([{"type": part, "text": item.content}] if isinstance(item.content, str)
                       else [p.model_dump() for p in item.content])
            out.append({"id": new_id("msg_"), "type": "message", "role": item.role,
                        "status": "completed", "content": content})
        elif isinstance(item, FunctionCallItem):
            out.append({"id": item.id or new_id("fc_"), "type": "function_call",
                        "call_id": item.call_id, "name": item.name,
                        "arguments": item.arguments, "status": "completed"})
        else:
            output = (item.output if isinstance(item.output, str)
                      else [p.model_dump() for p in item.output])
            out.append({"id": item.id or new_id("fco_"), "type": "function_call_output",
                        "call_id": item.call_id, "output": output, "status": "completed"})
    return out


def chat_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored input items as chat messages; `developer` speaks as `system`, which every chat
    template knows."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else "".join(
                p.get("text", "") for p in output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": "".join(
                p.get("text", "") for p in item["content"])})
    return messages


def check_calls_answered(messages: Sequence[dict[str, Any]]) -> None:
    """Every tool message answers a call made before it, and every call is answered (a 400
    with OpenAI's messages otherwise)."""
    made: list[str] = []
    answered: set[str] = set()
    for message in messages:
        for call in message.get("tool_calls") or []:
            made.append(str(call.get("id")))
        if message.get("role") == "tool":
            call_id = str(message.get("tool_call_id"))
            if call_id not in made:
                raise InvalidRequestError(f"No tool call found for function call output with "
                                          f"call_id {call_id}.", param="input")
            answered.add(call_id)
    for call_id in made:
        if call_id not in answered:
            raise InvalidRequestError(f"No tool output found for function call {call_id}.",
                                      param="input")
