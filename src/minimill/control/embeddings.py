"""POST /v1/embeddings: the body (validated as OpenAI validates it), the prepared row, and the
`list` of `embedding` objects rendered from a worker's result.

A request holds one input or a list of them (texts, or token ids); a worker returns one vector
per input as one result choice per input (protocol.ChoiceProgress.embedding), so the control
plane's checks and counts of choices serve embeddings too. Nothing is generated: a request is
billed for its prompt tokens alone.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from minimill.control.body_rules import PreparedBody, StrictBody, check_served, validate_body
from minimill.control.errors import InvalidRequestError
from minimill.control.records import Kind, Tier

# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingBody(StrictBody):
    """POST /v1/embeddings."""

    model: str = Field(min_length=1, max_length=200)
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text, a list of texts, a list of token ids, or a list of such lists "
                    f"(at most {MAX_INPUTS} inputs, none empty).")
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description='"float" (default): lists of numbers; "base64": little-endian '
                          "float32 bytes, base64-encoded.")
    dimensions: int | None = Field(
        None, ge=1, description="Not supported: the vectors have the model's hidden size (a "
                                "400 names it).")
    user: str | None = None

    @model_validator(mode="after")
    def _check_input(self) -> EmbeddingBody:
        inputs = embedding_inputs(self.input)
        if not inputs:
            raise ValueError("input: must not be empty")
        if len(inputs) > MAX_INPUTS:
            raise ValueError(f"input: at most {MAX_INPUTS} inputs per request, got "
                             f"{len(inputs)}")
        one = isinstance(self.input, str) or isinstance(self.input[0], int)
        for i, item in enumerate(inputs):
            where = "input" if one else f"input[{i}]"
            if not item:
                raise ValueError(f"{where}: must not be empty")
            if isinstance(item, list) and any(t < 0 for t in item):
                raise ValueError(f"{where}: token ids must be >= 0")
        if self.dimensions is not None:
            raise ValueError("dimensions: not supported: this model's embeddings have its "
                             "hidden size; leave dimensions out")
        return self


def embedding_inputs(value: Any) -> list[str | list[int]]:
    """The inputs of a body's `input`: a text, token ids, or a list of either (each one
    input)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [list(value)]
    if isinstance(value, list):
        return [v if isinstance(v, str) else list(v) for v in value
                if isinstance(v, str | list)]
    return []


def parse_embedding_body(raw: Any) -> EmbeddingBody:
    """Validate a raw (JSON-decoded) body, as a batch line; a 400 naming the param."""
    return validate_body(EmbeddingBody, raw)


def prepare_embedding(parsed: EmbeddingBody, served_models: Collection[str],
                      context_lengths: Mapping[str, int] | None = None) -> PreparedBody:
    """The row of an embedding request. Token-id inputs longer than the model's context are
    refused here; texts are checked where they are tokenized (the worker's engine)."""
    check_served(parsed.model, served_models)
    context = (context_lengths or {}).get(parsed.model)
    for i, item in enumerate(embedding_inputs(parsed.input)):
        if context is not None and isinstance(item, list) and len(item) > context:
            raise InvalidRequestError(
                f"input[{i}] has {len(item)} tokens; this model's context holds at most "
                f"{context} tokens.", param="input", code="context_length_exceeded")
    body = parsed.model_dump(mode="json", exclude_none=True)
    return PreparedBody(kind=Kind.EMBEDDING, model=parsed.model, body=body,
                        tier=Tier.REALTIME, stream=False, max_tokens=None, seed=None)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def check_vectors(choices: list[Any]) -> str | None:
    """Why a worker's embedding result is unusable (None: it is usable): every choice holds
    a vector, all of one length, of finite numbers, and nothing generated."""
    sizes = {len(c.embedding) if c.embedding is not None else 0 for c in choices}
    if 0 in sizes or len(sizes) > 1:
        return f"the result's embeddings have sizes {sorted(sizes)[:4]}; one common size > 0"
    if any(c.token_ids or c.text for c in choices):
        return "an embedding result carries generated tokens"
    if any(not math.isfinite(v) for c in choices for v in c.embedding):
        return "an embedding holds a value that is not finite"
    return None


def render_embeddings(model: str, body: Mapping[str, Any], choices: list[dict[str, Any]],
                      prompt_tokens: int, billed_usd: float) -> dict[str, Any]:
    """OpenAI's `list` of `embedding` objects, in input order, as `body` asked them encoded;
    `usage` with `cost_usd`, as every usage minimill renders (render.usage_dict)."""
    encoding_format = str(body.get("encoding_format") or "float")
    ordered = sorted(choices, key=lambda c: int(c.get("index", 0)))
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": int(c.get("index", 0)),
                      "embedding": _encoded(list(c.get("embedding") or []), encoding_format)}
                     for c in ordered],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "cost_usd": billed_usd}}
