"""OpenAI request bodies (chat and completions): validation and normalization.

One definition serves the HTTP routes (FastAPI validates against these models and publishes them
in the OpenAPI schema) and batch lines (validated here one by one), so a body that a realtime
call rejects is rejected the same way, with the same `param`, inside a batch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.records import Kind, Tier
from minimill.models.grammar import GrammarError, GuidedDecoding, check_grammar

MAX_CHOICES = 128
MAX_INT32 = 2**31 - 1
# OpenAI's default for /v1/completions when max_tokens is absent.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _Body(BaseModel):
    # Strict: "1" is not a number and true is not an integer, as in OpenAI's API. A field
    # minimill does not know is refused ("Unrecognized request argument supplied"), as
    # OpenAI refuses one: a parameter accepted and ignored would make a client believe it
    # was honoured.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Body):
    type: Literal["text"]
    text: str


# OpenAI's rule for function names (tools, tool_choice, calls).
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128


class FunctionCall(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(description="The call's arguments, as JSON text.")


class ToolCall(_Body):
    id: str = Field(min_length=1, max_length=200)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
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


class FunctionDefinition(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    # A JSON schema of the arguments (absent: a function without parameters).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(_Body):
    type: Literal["text"]


class ResponseFormatJsonObject(_Body):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


def type_tag(value: Any, default: str | None = None) -> str:
    """A union member's tag: its `type` as "type=...", which no error's `param` shows
    (param_from_loc keeps only identifiers), so errors name `input[0].arguments`, not
    `input[0].function_call.arguments`."""
    kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type",
                                                                              default)
    return f"type={kind}"


ResponseFormat = Annotated[Annotated[ResponseFormatText, Tag("type=text")]
                           | Annotated[ResponseFormatJsonObject, Tag("type=json_object")]
                           | Annotated[ResponseFormatJsonSchema, Tag("type=json_schema")],
                           Discriminator(type_tag)]


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Sampling(_Body):
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


def check_tools(tools: list[FunctionTool] | None,
                tool_choice: str | NamedToolChoice | None,
                parallel_tool_calls: bool | None) -> None:
    """OpenAI's rules for tools, tool_choice and parallel_tool_calls (errors name the
    parameter as `param: message`)."""
    if not tools:
        if tool_choice is not None:
            raise ValueError("tool_choice: only allowed when tools are specified")
        if parallel_tool_calls is not None:
            raise ValueError("parallel_tool_calls: only allowed when tools are specified")
        return
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise ValueError(f"tool_choice: the function {tool_choice.function.name!r} is not "
                         "in tools")


def mentions_json(messages: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a conversation asks for JSON in words: OpenAI refuses json_object output
    otherwise (a model told nothing about JSON may write whitespace until its limit)."""
    for message in messages:
        content = message.get("content")
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, Mapping) else part
            if isinstance(text, str) and "json" in text.lower():
                return True
    return False


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

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A parameter's path as validators name it in their messages ("tools[0].type").
_PARAM_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\[[0-9]+\]|\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Names pydantic puts in error locations for union members; they are not parameters.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def param_from_loc(loc: Sequence[int | str]) -> str | None:
    """`("messages", 0, "role")` -> "messages[0].role"; union-member tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _IDENT.match(part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


def describe_errors(errors: Sequence[Any], skip: int = 0) -> tuple[str, str | None]:
    """One message and `param` for pydantic errors (the first error is the one reported)."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = tuple(first.get("loc", ()))[skip:]
    param = param_from_loc(loc)
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if first.get("type") == "union_tag_invalid":  # a `type` no member of the union has
        ctx = first.get("ctx") or {}
        tag = str(ctx.get("tag", "")).removeprefix("type=")
        expected = str(ctx.get("expected_tags", "")).replace("type=", "")
        where = f"{param}.type" if param else "type"
        return f"Invalid value for '{where}': '{tag}'. Supported values are: {expected}.", where
    # Errors raised in validators name their parameter ("stop: ...").
    head, sep, rest = msg.removeprefix("Value error, ").partition(": ")
    if sep and _PARAM_PATH.match(head):
        return f"Invalid '{head}': {rest}", head if param is None else param
    where = f"'{param}'" if param else "the request body"
    return f"Invalid value for {where}: {msg}", param


@dataclass(frozen=True, slots=True)
class PreparedBody:
    """A validated body, normalized for workers, plus the fields the store keeps in columns."""

    kind: Kind
    model: str
    body: dict[str, Any]
    tier: Tier
    stream: bool
    max_tokens: int | None
    seed: int | None
    # The conversation it belongs to (requests.session_key); None: no session.
    session_key: str | None = None


def parse_body(kind: Kind, raw: Any) -> _Sampling:
    """Validate a raw (JSON-decoded) body; raises InvalidRequestError naming the param."""
    if not isinstance(raw, dict):
        raise InvalidRequestError("the body must be a JSON object", param="body")
    try:
        return BODY_MODELS[kind].model_validate(raw)
    except ValidationError as exc:
        message, param = describe_errors(exc.errors())
        raise InvalidRequestError(message, param=param) from None


def check_schemas(parsed: ChatBody) -> None:
    """Every schema the body gives (response_format, tools' parameters) compiles in the
    grammar engine that will enforce it; a 400 naming it otherwise."""
    checks: list[tuple[str, Any]] = []
    if isinstance(parsed.response_format, ResponseFormatJsonSchema):
        checks.append(("response_format.json_schema.schema",
                       parsed.response_format.json_schema.schema_ or {}))
    for i, tool in enumerate(parsed.tools or []):
        if tool.function.parameters is not None:
            checks.append((f"tools[{i}].function.parameters", tool.function.parameters))
    for param, schema in checks:
        check_schema(param, schema)


def check_schema(param: str, schema: Any) -> None:
    """A 400 naming `param` unless the grammar engine compiles `schema`."""
    try:
        check_grammar(GuidedDecoding(json_schema=json.dumps(schema)))
    except GrammarError as exc:
        raise InvalidRequestError(f"Invalid schema for '{param}': {exc}",
                                  param=param, code="invalid_json_schema") from None


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
    if parsed.model not in served_models:
        raise NotFoundError(f"The model '{parsed.model}' does not exist or you do not have "
                            f"access to it. Served: {', '.join(sorted(served_models))}.",
                            param="model", code="model_not_found")
    body = parsed.model_dump(mode="json", exclude_none=True, by_alias=True)
    max_tokens = parsed.max_tokens
    if isinstance(parsed, ChatBody):
        check_schemas(parsed)
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
