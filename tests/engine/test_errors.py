"""Bad input is refused up front with a typed error and a clear message."""

from __future__ import annotations

import pytest

from minimill.engine.config import EngineConfig
from minimill.engine.llm import LLM
from minimill.engine.params import InvalidRequestError, SamplingParams
from minimill.models.types import UnknownModelError


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], SamplingParams())


@pytest.mark.parametrize("kwargs, words", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_bad_sampling_params(kwargs: dict[str, float], words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_prompt_longer_than_the_context(llm: LLM) -> None:
    max_len = llm.config.max_model_len
    assert max_len is not None
    with pytest.raises(InvalidRequestError, match=f"holds {max_len} tokens"):
        llm.generate([[1] * max_len], SamplingParams())
    with pytest.raises(InvalidRequestError, match="resumed"):
        llm.generate([[1] * 10], SamplingParams(), resume_token_ids=[[1] * max_len])


def test_token_outside_the_vocabulary(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**9]], SamplingParams())


def test_mismatched_lists(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="2 prompts but 1 params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_a_bad_request_in_a_batch_runs_nothing(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished


def test_unknown_model_name() -> None:
    with pytest.raises(UnknownModelError, match="no-such-model"):
        LLM("no-such-model")


def test_bad_engine_settings() -> None:
    with pytest.raises(InvalidRequestError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(InvalidRequestError, match="block_size"):
        EngineConfig(block_size=0)
