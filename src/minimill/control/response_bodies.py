"""OpenAI Responses request bodies: validation, and the chat a worker runs for one.

A response runs as a chat over its whole conversation: `instructions` as the system message,
then the conversation of the previous responses (their inputs and outputs, function calls
included; their instructions are not carried over, as OpenAI documents), then this input (its
items become chat messages: response_items.py). Tools and `text.format` become the chat body's
`tools`, `tool_choice`, `parallel_tool_calls` and `response_format` (response_tools.py). The
request row's body is that chat body, plus the Responses parameters under `"response"` (what
rendering and `input_items` read), so workers need nothing new and a stored response is
self-contained: deleting an earlier one never breaks a later one.

One definition serves the HTTP route and `/v1/responses` batch lines, as bodies.py does for chat.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from minimill.control.body_rules import (
    MAX_INT32,
    PreparedBody,
    StrictBody,
    check_served,
    validate_body,
)
from minimill.control.errors import InvalidRequestError
from minimill.control.records import Kind, Tier
from minimill.control.response_items import (
    InputItem,
    InputMessage,
    chat_messages,
    check_calls_answered,
    refuse_unsupported_items,
    stored_items,
)
from minimill.control.response_tools import (
    AnyTextFormat,
    TextFormat,
    ToolChoice,
    Tools,
    chat_fields,
    check_tool_fields,
    check_tool_schemas,
    echoed,
    refuse_unsupported_tools,
)
from minimill.control.tool_bodies import mentions_json

MAX_METADATA_PAIRS = 16
MAX_ITEMS = 2048
# OpenAI Responses parameters that minimill does not honour: refused whenever given a value
# (null is no value), so that no client believes they worked.
UNSUPPORTED = ("access_programs", "background_options", "context_management", "image",
               "max_tool_calls", "moderation", "prompt", "prompt_cache_options",
               "prompt_cache_retention", "reasoning", "top_logprobs")


class TextConfig(StrictBody):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(
        None, description="Only medium: the models served here take no verbosity hint.")


class StreamOptions(StrictBody):
    include_obfuscation: Literal[False] | None = Field(
        None, description="Stream events are not padded (no obfuscation field).")


class ResponseBody(StrictBody):
    """POST /v1/responses."""

    model: str = Field(min_length=1, max_length=200)
    # The list first: an error inside a list of items then names the item at fault.
    input: list[InputItem] | str = Field(
        description="A user message as a string, or a list of items: messages, function "
                    "calls and function call outputs.")
    instructions: str | None = Field(None, description="The system message of this turn.")
    previous_response_id: str | None = Field(None, min_length=1, max_length=100)
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    background: bool | None = Field(
        None, description="Queue it and answer at once; billed at the background price.")
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex"] | None = None
    text: TextConfig | None = None
    prompt_cache_key: str | None = Field(
        None, min_length=1, max_length=200,
        description="Session key (default: the conversation's first response id).")
    user: str | None = Field(None, max_length=200)
    safety_identifier: str | None = Field(None, max_length=200)
    truncation: Literal["disabled"] | None = Field(
        None, description="Only disabled: a conversation longer than the context fails.")
    tools: Tools | None = Field(None, description="Function tools (no hosted tools).")
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = Field(None, max_length=0, description="Nothing to include.")
    conversation: None = Field(None, description="Not supported: use previous_response_id.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            for name in UNSUPPORTED:
                if raw.get(name) is not None:
                    raise ValueError(f"{name}: not supported by this server")
            if raw.get("include"):
                raise ValueError(f"include: {raw['include']!r}: nothing can be included")
            refuse_unsupported_tools(raw)
            refuse_unsupported_items(raw)
        return raw

    @model_validator(mode="after")
    def _check(self) -> ResponseBody:
        if isinstance(self.input, list) and not 1 <= len(self.input) <= MAX_ITEMS:
            raise ValueError(f"input: a list of 1 to {MAX_ITEMS} items")
        if self.background and self.store is False:
            raise ValueError("store: a background response must be stored (store: true)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.metadata is not None:
            if len(self.metadata) > MAX_METADATA_PAIRS:
                raise ValueError(f"metadata: at most {MAX_METADATA_PAIRS} pairs")
            if any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items()):
                raise ValueError("metadata: keys up to 64 and values up to 512 characters")
        check_tool_fields(self.tools, self.tool_choice)
        return self

    @property
    def text_format(self) -> AnyTextFormat | None:
        return self.text.format if self.text is not None else None


def parse_response_body(raw: Any) -> ResponseBody:
    """Validate a raw (JSON-decoded) body; raises InvalidRequestError naming the param."""
    return validate_body(ResponseBody, raw)


def conversation(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's conversation: its chat messages without its own instructions."""
    messages = list(body.get("messages") or [])
    return messages[1:] if (body.get("response") or {}).get("instructions") else messages


@dataclass(frozen=True, slots=True)
class Continuation:
    """What a new response takes from the response it continues."""

    conversation: list[dict[str, Any]]  # its chat messages, its instructions left out
    # Its answer as an assistant chat message (text, and calls the new input answers).
    answer: dict[str, Any]
    session_key: str | None


def _check_max_output_tokens(parsed: ResponseBody,
                             context_lengths: Mapping[str, int] | None) -> None:
    """An answer longer than the model's whole context is refused, as OpenAI does."""
    context = (context_lengths or {}).get(parsed.model)
    wanted = parsed.max_output_tokens
    if wanted is not None and context is not None and wanted > context:
        raise InvalidRequestError(f"max_output_tokens is too large: {wanted}. This model's "
                                  f"context holds at most {context} tokens.",
                                  param="max_output_tokens", code="invalid_value")


def prepare_response(parsed: ResponseBody, served_models: Collection[str], *,
                     previous: Continuation | None = None,
                     session_key: str | None = None,
                     context_lengths: Mapping[str, int] | None = None) -> PreparedBody:
    """The chat body a worker runs for this response, and its row's columns.

    `session_key` is the key when the request names none and continues nothing (the new
    response's own id for a conversation's first response); `context_lengths`: the served
    models' context lengths where known."""
    check_served(parsed.model, served_models)
    _check_max_output_tokens(parsed, context_lengths)
    check_tool_schemas(parsed.tools, parsed.text_format)
    items = stored_items([InputMessage(role="user", content=parsed.input)]
                         if isinstance(parsed.input, str) else parsed.input)
    history: list[dict[str, Any]] = []
    if previous is not None:
        history = [*previous.conversation, previous.answer]
        session_key = previous.session_key or session_key
    if parsed.prompt_cache_key is not None:
        session_key = parsed.prompt_cache_key
    turn = chat_messages(items)
    check_calls_answered([*history, *turn])
    system = [{"role": "system", "content": parsed.instructions}] if parsed.instructions else []
    tools = echoed(parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls,
                   parsed.text_format)
    spec = {"input": items, "instructions": parsed.instructions,
            "previous_response_id": parsed.previous_response_id,
            "background": bool(parsed.background), "store": parsed.store is not False,
            "metadata": parsed.metadata or {}, "service_tier": parsed.service_tier,
            "max_output_tokens": parsed.max_output_tokens, "temperature": parsed.temperature,
            "top_p": parsed.top_p, "prompt_cache_key": parsed.prompt_cache_key,
            "user": parsed.user, "safety_identifier": parsed.safety_identifier,
            "truncation": parsed.truncation,
            "verbosity": parsed.text.verbosity if parsed.text else None, **tools}
    body: dict[str, Any] = {"model": parsed.model, "messages": [*system, *history, *turn],
                            **chat_fields(parsed.tools, parsed.tool_choice,
                                          parsed.parallel_tool_calls, parsed.text_format),
                            "response": spec}
    if body.get("response_format", {}).get("type") == "json_object" and not mentions_json(
            body["messages"]):
        raise InvalidRequestError("Response input messages must contain the word 'json' in "
                                  "some form to use 'text.format' of type 'json_object'.",
                                  param="input")
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
