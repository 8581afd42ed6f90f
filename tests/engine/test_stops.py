"""Stop strings (also across tokens), stop token ids, eos and max_tokens (default model)."""

from __future__ import annotations

import pytest
from engine_helpers import PROMPTS

from minimill.engine.llm import LLM
from minimill.engine.output import RequestText
from minimill.engine.params import FinishReason, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def free_run(llm: LLM) -> RequestOutput:
    prompt = llm.tokenizer.encode(PROMPTS[3], add_special_tokens=True)
    return llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0,
                                                 ignore_eos=True))[0]


def token_spans(llm: LLM, tokens: list[int]) -> list[tuple[int, int]]:
    """(start, end) character offsets of each token's text within the decoded output."""
    spans, end = [], 0
    for i in range(len(tokens)):
        new_end = len(llm.tokenizer.decode(tokens[:i + 1]))
        spans.append((end, new_end))
        end = new_end
    return spans


def test_stop_string_spanning_tokens_is_cut_from_the_text(llm: LLM,
                                                          free_run: RequestOutput) -> None:
    tokens, text = free_run.output_token_ids, free_run.text
    spans = token_spans(llm, tokens)
    # A stop string from the last 2 characters of token j to the first 2 of token j + 1.
    j = next(i for i in range(5, len(tokens) - 1)
             if spans[i][1] - spans[i][0] >= 3 and spans[i + 1][1] - spans[i + 1][0] >= 3)
    stop = text[spans[j][1] - 2:spans[j + 1][0] + 2]
    cut = text.find(stop)
    out = llm.generate([free_run.prompt_token_ids],
                       SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                      stop=("never appears here", stop)))[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.text == text[:cut]
    assert stop not in out.text
    # Generation stopped at the token that completed the stop string.
    n = len(out.output_token_ids)
    assert out.output_token_ids == tokens[:n]
    assert spans[n - 1][1] >= cut + len(stop) > spans[n - 1][0]


def test_stop_token_id_and_max_tokens(llm: LLM, free_run: RequestOutput) -> None:
    tokens = free_run.output_token_ids
    stop_id = tokens[6]
    first = tokens.index(stop_id)
    out = llm.generate([free_run.prompt_token_ids],
                       SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                      stop_token_ids=(stop_id,)))[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.output_token_ids == tokens[:first + 1]
    # The stop token's own text is left out, as for eos.
    assert out.text == llm.tokenizer.decode(tokens[:first])
    short = llm.generate([free_run.prompt_token_ids],
                         SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert short.finish_reason == FinishReason.LENGTH and short.output_token_ids == tokens[:5]


def test_eos_ends_a_chat_answer(llm: LLM) -> None:
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.output_token_ids[-1] in llm.engine.eos_token_ids
    assert "Paris" in out.text and "<|im_end|>" not in out.text


def test_streamed_text_holds_back_a_possible_stop_prefix(llm: LLM) -> None:
    tok = llm.tokenizer
    ids = tok.encode("one two three four five")
    state = RequestText(tok, ("four five", "xyz"), [])
    pieces = []
    for i, token in enumerate(ids):
        stopped = state.add([token])
        pieces.append(state.take_delta(finished=stopped or i == len(ids) - 1))
        # What was handed out can never contain the start of "four five" mid-way.
        assert "four" not in "".join(pieces) or stopped
        if stopped:
            break
    assert "".join(pieces) == "one two three "
