"""Embedding bodies, rows and results in the control plane (no HTTP, no engine)."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest

from minimill.control.embeddings import (
    MAX_INPUTS,
    check_vectors,
    parse_embedding_body,
    prepare_embedding,
    render_embeddings,
)
from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.prompt_count import num_choices
from minimill.control.records import Kind
from minimill.transport.protocol import ChoiceProgress

SERVED = ("m",)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input[0]"),
    ({"input": ["a", ""]}, "input[1]"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "input"),
    ({"input": [1, -2]}, "input"),
    ({"input": "a", "dimensions": 8}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "n": 2}, "n"),
    ({"input": 5}, "input"),
    ({}, "input"),
])
def test_bad_bodies_name_their_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_embedding_body({"model": "m", **body})
    assert info.value.param == param


def test_a_prepared_row_asks_one_choice_per_input() -> None:
    parsed = parse_embedding_body({"model": "m", "input": [[1, 2], [3]], "user": "u"})
    prepared = prepare_embedding(parsed, SERVED)
    assert prepared.kind == Kind.EMBEDDING and not prepared.stream
    assert prepared.body == {"model": "m", "input": [[1, 2], [3]], "user": "u"}
    assert num_choices(Kind.EMBEDDING, prepared.body) == 2
    assert num_choices(Kind.EMBEDDING, {"input": [1, 2, 3]}) == 1
    with pytest.raises(NotFoundError):
        prepare_embedding(parse_embedding_body({"model": "x", "input": "a"}), SERVED)
    with pytest.raises(InvalidRequestError) as info:
        prepare_embedding(parse_embedding_body({"model": "m", "input": [[1] * 9]}), SERVED,
                          {"m": 8})
    assert info.value.code == "context_length_exceeded"


def test_rendered_in_input_order_as_floats_or_base64() -> None:
    choices = [{"index": 1, "embedding": [0.25, -1.5]}, {"index": 0, "embedding": [1.0, 0.0]}]
    plain = render_embeddings("m", {}, choices, 7, 0.5)
    assert [d["embedding"] for d in plain["data"]] == [[1.0, 0.0], [0.25, -1.5]]
    assert plain["usage"] == {"prompt_tokens": 7, "total_tokens": 7, "cost_usd": 0.5}
    packed = render_embeddings("m", {"encoding_format": "base64"}, choices, 7, 0.5)
    raw = base64.b64decode(packed["data"][1]["embedding"])
    assert struct.unpack("<2f", raw) == (0.25, -1.5)


def test_unusable_vectors_are_named() -> None:
    def c(i: int, vec: list[float] | None, **kw: Any) -> ChoiceProgress:
        return ChoiceProgress(index=i, embedding=vec, **kw)

    assert check_vectors([c(0, [1.0]), c(1, [0.5])]) is None
    assert check_vectors([c(0, [1.0]), c(1, None)]) is not None
    assert check_vectors([c(0, [1.0]), c(1, [1.0, 2.0])]) is not None
    assert check_vectors([c(0, [])]) is not None
    assert check_vectors([c(0, [1.0], token_ids=[3])]) is not None
    with pytest.raises(ValueError, match="finite"):
        c(0, [float("nan")])
