"""What every OpenAI-shaped request body shares: strict models that refuse unknown fields,
pydantic errors turned into OpenAI's message and `param`, the model check, and the prepared
row a validated body becomes (bodies.py: chat and completions; response_bodies.py: responses;
embeddings.py: embeddings)."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.records import Kind, Tier

MAX_INT32 = 2**31 - 1
# OpenAI's rule for function names (tools, tool_choice, calls).
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class StrictBody(BaseModel):
    # Strict: "1" is not a number and true is not an integer, as in OpenAI's API. A field
    # minimill does not know is refused ("Unrecognized request argument supplied"), as
    # OpenAI refuses one: a parameter accepted and ignored would make a client believe it
    # was honoured.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def type_tag(value: Any, default: str | None = None) -> str:
    """A union member's tag: its `type` as "type=...", which no error's `param` shows
    (param_from_loc keeps only identifiers), so errors name `input[0].arguments`, not
    `input[0].function_call.arguments`."""
    kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type",
                                                                              default)
    return f"type={kind}"


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


M = TypeVar("M", bound=BaseModel)


def validate_body(model: type[M], raw: Any) -> M:
    """Validate a raw (JSON-decoded) body; raises InvalidRequestError naming the param."""
    if not isinstance(raw, dict):
        raise InvalidRequestError("the body must be a JSON object", param="body")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message, param = describe_errors(exc.errors())
        raise InvalidRequestError(message, param=param) from None


def check_served(model: str, served_models: Collection[str]) -> None:
    """A 404 unless `model` is served, as OpenAI answers an unknown model."""
    if model not in served_models:
        raise NotFoundError(f"The model '{model}' does not exist or you do not have access "
                            f"to it. Served: {', '.join(sorted(served_models))}.",
                            param="model", code="model_not_found")


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
