"""Request body validation and normalization, shared by realtime calls and batch lines."""

from __future__ import annotations

from typing import Any

import pytest

from minimill.control.bodies import parse_body, prepare_body
from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.records import Kind, Tier

MODEL = "smollm2-135m"
MSG = [{"role": "user", "content": "hi"}]


def chat(**body: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSG, **body}


@pytest.mark.parametrize(("body", "param"), [
    ({"model": MODEL}, "messages"),
    (chat(messages=[{"role": "user"}]), "messages[0]"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (chat(n=0), "n"),
    (chat(n=True), "n"),
    (chat(temperature="0.5"), "temperature"),
    (chat(top_p=1.5), "top_p"),
    (chat(max_tokens=-1), "max_tokens"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(top_logprobs=21, logprobs=True), "top_logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(stop=["a"] * 5), "stop"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(service_tier="scale"), "service_tier"),
])
def test_chat_errors_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_body(Kind.CHAT, body)
    assert info.value.param == param
    assert info.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [[]]}, "prompt"),
    ({"model": MODEL, "prompt": [-1]}, "prompt"),
    ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": MODEL, "prompt": ["a"] * 65, "n": 2}, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs"),
])
def test_completion_errors_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_body(Kind.COMPLETION, body)
    assert info.value.param == param


def test_body_must_be_an_object() -> None:
    with pytest.raises(InvalidRequestError):
        parse_body(Kind.CHAT, ["model"])


def test_chat_normalization() -> None:
    parsed = parse_body(Kind.CHAT, chat(
        messages=[{"role": "system", "content": [{"type": "text", "text": "a"},
                                                 {"type": "text", "text": "b"}]},
                  {"role": "user", "content": "q"}],
        max_completion_tokens=7, max_tokens=9, service_tier="flex", seed=3, user="u"))
    prepared = prepare_body(Kind.CHAT, parsed, [MODEL])
    assert prepared.body["messages"] == [{"role": "system", "content": "ab"},
                                         {"role": "user", "content": "q"}]
    assert prepared.max_tokens == 7 and prepared.seed == 3
    assert prepared.tier == Tier.BACKGROUND and not prepared.stream


@pytest.mark.parametrize(("body", "param"), [
    (chat(reasoning_effort="high"), "reasoning_effort"),
    (chat(messages=[{"role": "user", "content": "q", "unknown_field": 1}]),
     "messages[0].unknown_field"),
    (chat(functions=[{"name": "f"}]), "functions"),
])
def test_a_parameter_minimill_does_not_know_is_refused_by_name(body: dict[str, Any],
                                                               param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_body(Kind.CHAT, body)
    assert info.value.param == param
    assert "Unrecognized request argument" in info.value.message


def test_completion_default_max_tokens_and_prompt_forms() -> None:
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1], [2, 3]]):
        prepared = prepare_body(Kind.COMPLETION,
                                parse_body(Kind.COMPLETION, {"model": MODEL, "prompt": prompt}),
                                [MODEL])
        assert prepared.body["max_tokens"] == 16 and prepared.body["prompt"] == prompt
        assert prepared.tier == Tier.REALTIME


def test_unknown_model_is_not_found() -> None:
    with pytest.raises(NotFoundError) as info:
        prepare_body(Kind.CHAT, parse_body(Kind.CHAT, chat(model="gpt-x")), [MODEL])
    assert info.value.code == "model_not_found" and info.value.param == "model"
