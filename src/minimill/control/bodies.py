"""OpenAI request bodies (chat and completions): validation and normalization.

One definition serves the HTTP routes (FastAPI validates against these models and publishes them
in the OpenAPI schema) and batch lines (validated here one by one), so a body that a realtime
call rejects is rejected the same way, with the same `param`, inside a batch.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.records import Kind, Tier

MAX_CHOICES = 128
MAX_INT32 = 2**31 - 1
# OpenAI's default for /v1/completions when max_tokens is absent.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _Body(BaseModel):
    # Strict: "1" is not a number and true is not an integer, as in OpenAI's API. Unknown
    # fields are ignored, so clients that send extra OpenAI parameters still work.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


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

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatBody:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is set")
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
    # Errors raised in validators name their parameter ("stop: ...").
    head, sep, rest = msg.removeprefix("Value error, ").partition(": ")
    if sep and _IDENT.match(head):
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


def prepare_body(kind: Kind, parsed: _Sampling, served_models: Collection[str]) -> PreparedBody:
    """Check the model is served and normalize: text parts joined, OpenAI defaults filled."""
    if parsed.model not in served_models:
        raise NotFoundError(f"The model '{parsed.model}' does not exist or you do not have "
                            f"access to it. Served: {', '.join(sorted(served_models))}.",
                            param="model", code="model_not_found")
    body = parsed.model_dump(mode="json", exclude_none=True)
    max_tokens = parsed.max_tokens
    if isinstance(parsed, ChatBody):
        for message in body["messages"]:
            if isinstance(message.get("content"), list):
                message["content"] = "".join(part["text"] for part in message["content"])
        max_tokens = parsed.max_completion_tokens or max_tokens
    elif max_tokens is None:
        max_tokens = body["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    tier = Tier.BACKGROUND if parsed.service_tier == "flex" else Tier.REALTIME
    session_key = parsed.prompt_cache_key
    return PreparedBody(kind=kind, model=parsed.model, body=body, tier=tier,
                        stream=bool(parsed.stream), max_tokens=max_tokens, seed=parsed.seed,
                        session_key=session_key)
