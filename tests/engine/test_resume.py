"""A request resumed from a checkpoint of its first k tokens finishes exactly as the
uninterrupted run (default model, float32), greedy and seeded sampling alike."""

from __future__ import annotations

import pytest
from engine_helpers import PROMPTS, assert_greedy_close

from minimill.engine.llm import LLM
from minimill.engine.params import FinishReason, SamplingParams

WHY = ("the resumed tokens' keys and values come from one prefill matmul instead of one-token "
       "decode steps, so float32 sums are ordered differently")
CHECKPOINTS = (1, 7, 16, 33)


@pytest.fixture(scope="module")
def prompt(llm: LLM) -> list[int]:
    return llm.tokenizer.encode(PROMPTS[2], add_special_tokens=True)


def test_greedy_resume_continues_exactly(llm: LLM, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=48, temperature=0.0, top_logprobs=5, ignore_eos=True)
    full = llm.generate([prompt], params)[0]
    assert full.logprobs is not None and len(full.output_token_ids) == 48
    resumed = llm.generate([prompt] * len(CHECKPOINTS), params,
                           resume_token_ids=[full.output_token_ids[:k] for k in CHECKPOINTS])
    for k, out in zip(CHECKPOINTS, resumed, strict=True):
        assert out.output_token_ids[:k] == full.output_token_ids[:k]
        assert len(out.output_token_ids) == 48  # max_tokens counts the resumed tokens
        assert out.logprobs is not None and len(out.logprobs) == 48 - k
        assert_greedy_close(out.output_token_ids[k:], [lp.top for lp in out.logprobs],
                            full.output_token_ids[k:], [lp.top for lp in full.logprobs[k:]],
                            WHY)
        assert out.text == full.text


def test_seeded_sampling_resume_continues_exactly(llm: LLM, prompt: list[int]) -> None:
    # A drawn seed is reported; resuming with it reproduces the uninterrupted run. A sampled
    # token could only differ if the hashed uniform fell within ~1e-6 of a CDF step, which is
    # far too unlikely to happen here, so equality is exact.
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, ignore_eos=True)
    full = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95,
                                                  ignore_eos=True, seed=full.seed))[0]
    assert again.output_token_ids == full.output_token_ids
    seeded = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, ignore_eos=True,
                            seed=full.seed)
    resumed = llm.generate([prompt] * len(CHECKPOINTS), seeded,
                           resume_token_ids=[full.output_token_ids[:k] for k in CHECKPOINTS])
    for out in resumed:
        assert out.seed == full.seed
        assert out.output_token_ids == full.output_token_ids
        assert out.text == full.text
    other = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95,
                                                  ignore_eos=True, seed=full.seed + 1))[0]
    assert other.output_token_ids != full.output_token_ids


def test_resume_with_every_token_already_finishes(llm: LLM, prompt: list[int]) -> None:
    done = [11, 12, 13]
    out = llm.generate([prompt], SamplingParams(max_tokens=3),
                       resume_token_ids=[done])[0]
    assert out.output_token_ids == done
    assert out.finish_reason == FinishReason.LENGTH
    assert out.text == llm.tokenizer.decode(done)
