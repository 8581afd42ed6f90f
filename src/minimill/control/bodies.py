"""OpenAI request bodies (chat and completions): validation and normalization.

One definition serves the HTTP routes (FastAPI validates against these models and publishes them
in the OpenAPI schema) and batch lines (validated here one by one), so a body that a realtime
call rejects is rejected the same way, with the same `param`, inside a batch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Annotated, Any, Literal

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
from minimill.control.tool_bodies import (
    MAX_TOOLS,
    FunctionTool,
    NamedToolChoice,
    ResponseFormat,
    ResponseFormatJsonObject,
    ToolCall,
    check_schemas,
    check_tools,
    mentions_json,
)

MAX_CHOICES = 128
# OpenAI's default for /v1/completions when max_tokens is absent.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant message's calls, and the call a tool message answers.
    tool_calls: list[ToolCall] | None = Field(None, min_length=1)
    tool_call_id: str | None = Field(None, min_length=1, max_length=200)
    # What an answer carried that a client sends back with it in the next turn's history
    # (the openai client's message objects hold them); not part of the prompt.
    refusal: str | None = None
    annotations: list[Any] | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.content is None and self.role == "assistant" and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only tool messages answer a call")
        return self


class StreamOptions(StrictBody):
    include_usage: bool | None = None


class _Sampling(StrictBody):
    model: str = Field(min_length=1, max_length=200)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = Field(None, description="Up to 4 stop strings.")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    service_tier: Literal["auto", "default", "flex"] | None = Field(
        None, description='"auto"/"default": realtime; "flex": background, priced lower.')
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    # Token id (as a JSON object key) -> bias in [-100, 100] added to that token's logit.
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                     Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=1024)
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(
        None, min_length=1, max_length=200,
        description="Groups requests of one conversation (the session key the KV cache and "
                    "placement use).")

    @model_validator(mode="after")
    def _check_common(self) -> _Sampling:
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 stop sequences")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self


class ChatBody(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Only text out; chat completions are not stored (the Responses API stores responses).
    modalities: list[Literal["text"]] | None = None
    store: Literal[False] | None = Field(None, description="Only false: chat completions are "
                                         "not stored.")
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatBody:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is set")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatBody:
        check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        check_tool_messages(self.messages)
        if isinstance(self.response_format, ResponseFormatJsonObject) and not mentions_json(
                m.model_dump() for m in self.messages):
            raise ValueError("messages: 'messages' must contain the word 'json' in some form, "
                             "to use 'response_format' of type 'json_object'")
        return self


class CompletionBody(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionBody:
        if isinstance(self.prompt, list):
            if not self.prompt or any(isinstance(p, list) and not p for p in self.prompt):
                raise ValueError("prompt: must not be empty")
            if any(isinstance(t, int) and t < 0 for t in _flat_ints(self.prompt)):
                raise ValueError("prompt: token ids must be >= 0")
        if self.echo:
            raise ValueError("echo: not supported")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of: only best_of equal to n is supported")
        if _num_prompts(self.prompt) * (self.n or 1) > MAX_CHOICES:
            raise ValueError(f"n: prompts times n must be at most {MAX_CHOICES}")
        return self


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """Every tool message answers a call of the assistant message before it, and every call
    of an assistant message is answered before the conversation goes on (as OpenAI checks)."""
    open_calls: set[str] = set()
    for i, message in enumerate(messages):
        if message.role == "tool":
            if message.tool_call_id not in open_calls:
                raise ValueError(f"messages: messages[{i}] with role 'tool' must answer a "
                                 "tool_call_id of a preceding assistant message with "
                                 "'tool_calls'")
            open_calls.discard(message.tool_call_id or "")
            continue
        if open_calls:
            raise ValueError(f"messages: an assistant message with 'tool_calls' must be "
                             f"followed by tool messages answering each call; no answer "
                             f"for: {', '.join(sorted(open_calls))}")
        if message.tool_calls:
            open_calls = {c.id for c in message.tool_calls}
    if open_calls:
        raise ValueError(f"messages: an assistant message with 'tool_calls' must be followed "
                         f"by tool messages answering each call; no answer for: "
                         f"{', '.join(sorted(open_calls))}")


def _flat_ints(prompt: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for p in prompt:
        out.extend(p if isinstance(p, list) else [p])
    return out


def _num_prompts(prompt: str | list[Any]) -> int:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


BODY_MODELS: dict[Kind, type[_Sampling]] = {Kind.CHAT: ChatBody, Kind.COMPLETION: CompletionBody}

def parse_body(kind: Kind, raw: Any) -> _Sampling:
    """Validate a raw (JSON-decoded) body; raises InvalidRequestError naming the param."""
    return validate_body(BODY_MODELS[kind], raw)


def check_max_tokens(parsed: _Sampling, max_tokens: int | None,
                     context_lengths: Mapping[str, int] | None) -> None:
    """A completion longer than the model's whole context is refused, as OpenAI does."""
    context = (context_lengths or {}).get(parsed.model)
    if max_tokens is None or context is None or max_tokens <= context:
        return
    param = ("max_completion_tokens" if isinstance(parsed, ChatBody)
             and parsed.max_completion_tokens is not None else "max_tokens")
    raise InvalidRequestError(f"{param} is too large: {max_tokens}. This model's context "
                              f"holds at most {context} tokens.", param=param,
                              code="invalid_value")


def prepare_body(kind: Kind, parsed: _Sampling, served_models: Collection[str],
                 context_lengths: Mapping[str, int] | None = None) -> PreparedBody:
    """Check the model is served and normalize: text parts joined, OpenAI defaults filled.
    `context_lengths`: the served models' context lengths where known."""
    check_served(parsed.model, served_models)
    body = parsed.model_dump(mode="json", exclude_none=True, by_alias=True)
    max_tokens = parsed.max_tokens
    if isinstance(parsed, ChatBody):
        check_schemas(parsed.response_format, parsed.tools)
        for message in body["messages"]:
            if isinstance(message.get("content"), list):
                message["content"] = "".join(part["text"] for part in message["content"])
        max_tokens = parsed.max_completion_tokens or max_tokens
    elif max_tokens is None:
        max_tokens = body["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    check_max_tokens(parsed, max_tokens, context_lengths)
    tier = Tier.BACKGROUND if parsed.service_tier == "flex" else Tier.REALTIME
    session_key = parsed.prompt_cache_key
    return PreparedBody(kind=kind, model=parsed.model, body=body, tier=tier,
                        stream=bool(parsed.stream), max_tokens=max_tokens, seed=parsed.seed,
                        session_key=session_key)
