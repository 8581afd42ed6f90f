"""A request resumed from a checkpoint taken after any number of tokens hands out exactly the
uninterrupted run's text, tokens and logprobs: checkpoint text + new deltas == full text, even
when the checkpoint ends inside a multi-byte character or inside a held-back prefix of a stop
string (default model, float32 and bfloat16).

Exactly, not approximately: the engine is batch-invariant (a row's numbers do not depend on
what else is in its batch, or on whether it is computed in a prompt chunk or a decode step),
so the resumed tokens' keys and values, prefilled in one chunk, are the very numbers the
uninterrupted run computed one decode step at a time."""

from __future__ import annotations

import pytest

from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams, TokenLogprob

# Prompts whose continuations split characters over several tokens (emoji, Japanese) and one
# in plain Latin text; the stop strings never match, so the last few characters are always
# held back while the request runs.
PROMPTS = ["Emoji story: 🎉🎂🎈 Today we celebrate 🥳", "日本語の文章：こんにちは、今日は",  # noqa: RUF001
           "Le café était très chaud. Où est la gare ? Ça"]
NEVER = ("<<never-here>>", "zzzz")
MAX_TOKENS = 24


def stream(llm: LLM, prompt: list[int], params: SamplingParams
           ) -> tuple[list[int], list[str], list[TokenLogprob]]:
    """Run uninterrupted; per token, the text handed out once it was generated."""
    core = llm.engine
    core.add_request("uninterrupted", prompt, params)
    ids: list[int] = []
    texts = [""]
    logprobs: list[TokenLogprob] = []
    handed_out = ""
    while core.has_unfinished:
        for delta in core.step().deltas:
            assert len(delta.new_token_ids) <= 1
            handed_out += delta.new_text
            if delta.new_token_ids:
                ids += delta.new_token_ids
                logprobs += delta.logprobs or []
                texts.append(handed_out)
            elif delta.finish_reason is not None:
                texts[-1] = handed_out  # the flush at the end belongs to the last token
    return ids, texts, logprobs


@pytest.fixture(params=["float32", "bfloat16"])
def engine(request: pytest.FixtureRequest) -> LLM:
    return request.getfixturevalue("llm" if request.param == "float32" else "llm_bf16")


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=NEVER,
                   logprobs=True, top_logprobs=2),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=1234,
                   ignore_eos=True, stop=NEVER, logprobs=True),
], ids=["greedy", "seeded"])
def test_resume_at_every_token_hands_out_the_uninterrupted_text(engine: LLM,
                                                               params: SamplingParams) -> None:
    llm = engine
    tok = llm.tokenizer
    split_checkpoints = held_back_checkpoints = 0
    for text_prompt in PROMPTS:
        prompt = tok.encode(text_prompt, add_special_tokens=True)
        ids, texts, logprobs = stream(llm, prompt, params)
        full = texts[-1]
        assert len(ids) == MAX_TOKENS
        cuts = list(range(1, MAX_TOKENS))
        for k in cuts:
            decoded = tok.decode(ids[:k])
            split_checkpoints += decoded.endswith("\ufffd")
            held_back_checkpoints += len(texts[k]) < len(decoded.rstrip("\ufffd"))
        resumed = llm.generate([prompt] * len(cuts), params,
                               resume_token_ids=[ids[:k] for k in cuts],
                               resume_texts=[texts[k] for k in cuts])
        for k, out in zip(cuts, resumed, strict=True):
            assert out.output_token_ids == ids, f"tokens differ after a cut at {k}"
            assert out.text == full, f"text differs after a cut at {k}: {out.text!r}"
            assert out.logprobs is not None and len(out.logprobs) == MAX_TOKENS - k
            for got, want in zip(out.logprobs, logprobs[k:], strict=True):
                assert got.token_id == want.token_id
                assert got.logprob == want.logprob
                assert got.top == want.top
    # The cuts did land where it is hard: inside characters and inside held-back text.
    assert split_checkpoints > 0 and held_back_checkpoints > 0


def test_a_split_character_is_not_handed_out_twice(llm: LLM) -> None:
    tok = llm.tokenizer
    prompt = tok.encode(PROMPTS[0], add_special_tokens=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids, texts, _ = stream(llm, prompt, params)
    k = next(k for k in range(1, MAX_TOKENS)
             if texts[k] and tok.decode(ids[:k]).endswith("\ufffd"))
    out = llm.generate([prompt], params, resume_token_ids=[ids[:k]],
                       resume_texts=[texts[k]])[0]
    assert out.text == texts[-1]
    assert not out.text.startswith(texts[k] + texts[k])
