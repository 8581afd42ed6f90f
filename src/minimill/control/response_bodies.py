"""OpenAI Responses request bodies: validation, and the chat a worker runs for one.

A response runs as a chat over its whole conversation: `instructions` as the system message,
then the conversation of the previous responses (their inputs and outputs; their instructions
are not carried over, as OpenAI documents), then this input. The request row's body is that chat
body, plus the Responses parameters under `"response"` (what rendering and `input_items` read),
so workers need nothing new and a stored response is self-contained: deleting an earlier one
never breaks a later one.

One definition serves the HTTP route and `/v1/responses` batch lines, as bodies.py does for chat.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from minimill.control.bodies import MAX_INT32, PreparedBody, _Body, describe_errors
from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.records import Kind, Tier, new_id

MAX_METADATA_PAIRS = 16
MAX_ITEMS = 2048


class InputPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Body):
    """A message item (OpenAI's EasyInputMessage or input message); other item types (tool
    calls and their outputs, references) are not supported."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[InputPart] | str


class TextFormat(_Body):
    type: Literal["text"] = Field(description="Only plain text output is supported.")


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponseBody(_Body):
    """POST /v1/responses."""

    model: str = Field(min_length=1, max_length=200)
    # The list first: an error inside a list of items then names the item at fault.
    input: list[InputMessage] | str = Field(
        description="A user message as a string, or a list of message items.")
    instructions: str | None = Field(None, description="The system message of this turn.")
    previous_response_id: str | None = Field(None, min_length=1, max_length=100)
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool | None = None
    background: bool | None = Field(
        None, description="Queue it and answer at once; billed at the background price.")
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex"] | None = None
    text: TextConfig | None = None
    prompt_cache_key: str | None = Field(
        None, min_length=1, max_length=200,
        description="Session key (default: the conversation's first response id).")
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none", "auto"] | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="Tools are not supported.")
    include: list[str] | None = None
    conversation: None = Field(None, description="Not supported: use previous_response_id.")

    @model_validator(mode="after")
    def _check(self) -> ResponseBody:
        if isinstance(self.input, list) and not 1 <= len(self.input) <= MAX_ITEMS:
            raise ValueError(f"input: a list of 1 to {MAX_ITEMS} items")
        if self.tools:
            raise ValueError("tools: not supported by this server")
        if self.background and self.store is False:
            raise ValueError("store: a background response must be stored (store: true)")
        if self.metadata is not None:
            if len(self.metadata) > MAX_METADATA_PAIRS:
                raise ValueError(f"metadata: at most {MAX_METADATA_PAIRS} pairs")
            if any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items()):
                raise ValueError("metadata: keys up to 64 and values up to 512 characters")
        return self


def parse_response_body(raw: Any) -> ResponseBody:
    """Validate a raw (JSON-decoded) body; raises InvalidRequestError naming the param."""
    if not isinstance(raw, dict):
        raise InvalidRequestError("the body must be a JSON object", param="body")
    try:
        return ResponseBody.model_validate(raw)
    except ValidationError as exc:
        message, param = describe_errors(exc.errors())
        raise InvalidRequestError(message, param=param) from None


def input_items(parsed: ResponseBody) -> list[dict[str, Any]]:
    """The input as OpenAI's input items (what `input_items` lists), each with an id."""
    messages = ([InputMessage(role="user", content=parsed.input)]
                if isinstance(parsed.input, str) else parsed.input)
    items = []
    for message in messages:
        part = "output_text" if message.role == "assistant" else "input_text"
        content = ([{"type": part, "text": message.content}] if isinstance(message.content, str)
                   else [p.model_dump() for p in message.content])
        items.append({"id": new_id("msg_"), "type": "message", "role": message.role,
                      "status": "completed", "content": content})
    return items


def chat_message(item: dict[str, Any]) -> dict[str, str]:
    """An input item as a chat message; `developer` speaks as `system`, which every chat
    template knows."""
    role = "system" if item["role"] == "developer" else item["role"]
    return {"role": role, "content": "".join(p.get("text", "") for p in item["content"])}


def conversation(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's conversation: its chat messages without its own instructions."""
    messages = list(body.get("messages") or [])
    return messages[1:] if (body.get("response") or {}).get("instructions") else messages


@dataclass(frozen=True, slots=True)
class Continuation:
    """What a new response takes from the response it continues."""

    conversation: list[dict[str, Any]]  # its chat messages, its instructions left out
    output_text: str  # its answer, which the conversation continues after
    session_key: str | None


def prepare_response(parsed: ResponseBody, served_models: Collection[str], *,
                     previous: Continuation | None = None,
                     session_key: str | None = None) -> PreparedBody:
    """The chat body a worker runs for this response, and its row's columns.

    `session_key` is the key when the request names none and continues nothing (the new
    response's own id for a conversation's first response)."""
    if parsed.model not in served_models:
        raise NotFoundError(f"The model '{parsed.model}' does not exist or you do not have "
                            f"access to it. Served: {', '.join(sorted(served_models))}.",
                            param="model", code="model_not_found")
    items = input_items(parsed)
    history: list[dict[str, Any]] = []
    if previous is not None:
        history = [*previous.conversation,
                   {"role": "assistant", "content": previous.output_text}]
        session_key = previous.session_key or session_key
    if parsed.prompt_cache_key is not None:
        session_key = parsed.prompt_cache_key
    system = [{"role": "system", "content": parsed.instructions}] if parsed.instructions else []
    spec = {"input": items, "instructions": parsed.instructions,
            "previous_response_id": parsed.previous_response_id,
            "background": bool(parsed.background), "store": parsed.store is not False,
            "metadata": parsed.metadata or {}, "service_tier": parsed.service_tier,
            "max_output_tokens": parsed.max_output_tokens, "temperature": parsed.temperature,
            "top_p": parsed.top_p, "prompt_cache_key": parsed.prompt_cache_key,
            "user": parsed.user, "truncation": parsed.truncation,
            "verbosity": parsed.text.verbosity if parsed.text else None}
    body: dict[str, Any] = {"model": parsed.model,
                            "messages": [*system, *history, *map(chat_message, items)],
                            "response": spec}
    for name, value in (("max_completion_tokens", parsed.max_output_tokens),
                        ("temperature", parsed.temperature), ("top_p", parsed.top_p),
                        ("seed", parsed.seed)):
        if value is not None:
            body[name] = value
    background = bool(parsed.background) or parsed.service_tier == "flex"
    return PreparedBody(kind=Kind.RESPONSE, model=parsed.model, body=body,
                        tier=Tier.BACKGROUND if background else Tier.REALTIME,
                        stream=bool(parsed.stream), max_tokens=parsed.max_output_tokens,
                        seed=parsed.seed, session_key=session_key)


def prepare_batch_line(raw: Any, served_models: Collection[str]) -> PreparedBody:
    """A `/v1/responses` batch line: a conversation's first turn (a line cannot wait on a
    response that another line produces)."""
    parsed = parse_response_body(raw)
    if parsed.previous_response_id is not None:
        raise InvalidRequestError("previous_response_id is not supported inside a batch",
                                  param="previous_response_id")
    if parsed.background:
        raise InvalidRequestError("background is not supported inside a batch (every line "
                                  "runs in the background)", param="background")
    return prepare_response(parsed, served_models)
