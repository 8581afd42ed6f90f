"""The async front end: concurrent streams, abort, per-request failures, bad input, resume."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from engine_helpers import PROMPTS, assert_greedy_close

from minimill.engine.async_engine import AsyncEngine
from minimill.engine.llm import LLM
from minimill.engine.params import (
    EngineError,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    TokenDelta,
)
from minimill.models.types import LoadedModel

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
WHY = ("the two engines batch the prompts differently, so float32 sums are blocked "
       "differently and a near-tie between the two best tokens can flip")


@pytest.fixture(scope="module")
def engine(smol_f32: LoadedModel) -> Iterator[AsyncEngine]:
    eng = AsyncEngine(smol_f32, dtype="float32", num_kv_blocks=512, max_model_len=2048)
    yield eng
    eng.close()


async def collect(engine: AsyncEngine, request_id: str, prompt: str | list[int],
                  params: SamplingParams, **kwargs: list[int]) -> list[TokenDelta]:
    return [d async for d in engine.generate(request_id, prompt, params, **kwargs)]


def test_concurrent_requests_match_the_offline_engine(engine: AsyncEngine, llm: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, top_logprobs=5)
    offline = llm.generate(PROMPTS, params)

    async def main() -> list[list[TokenDelta]]:
        return await asyncio.gather(*(collect(engine, f"c{i}", p, params)
                                      for i, p in enumerate(PROMPTS)))

    streams = asyncio.run(main())
    for deltas, ref in zip(streams, offline, strict=True):
        tokens = [t for d in deltas for t in d.new_token_ids]
        tops = [lp.top for d in deltas for lp in (d.logprobs or [])]
        assert ref.logprobs is not None and len(tops) == len(tokens)
        equal = assert_greedy_close(tokens, tops, ref.output_token_ids,
                                    [lp.top for lp in ref.logprobs], WHY)
        if equal == len(tokens):
            assert "".join(d.new_text for d in deltas) == ref.text
        assert deltas[-1].finish_reason == FinishReason.LENGTH
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert deltas[0].num_prompt_tokens == len(ref.prompt_token_ids)
    assert engine.recent_output_tok_s() > 0
    assert engine.num_running == 0 and engine.max_num_seqs == 256


def test_abort_ends_one_stream_and_others_finish(engine: AsyncEngine) -> None:
    async def main() -> tuple[list[TokenDelta], list[TokenDelta]]:
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        other = asyncio.create_task(collect(engine, "other", PROMPTS[1], GREEDY))
        got: list[TokenDelta] = []
        async for delta in engine.generate("victim", PROMPTS[0], long):
            got.append(delta)
            if len(got) == 3:
                engine.abort("victim")
        return got, await other

    victim, other = asyncio.run(main())
    assert victim[-1].finish_reason == FinishReason.ABORT
    assert len([t for d in victim for t in d.new_token_ids]) < 500
    assert other[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(d.new_token_ids) for d in other) == 24


def test_leaving_a_stream_early_aborts_it(engine: AsyncEngine) -> None:
    async def main() -> None:
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate("leaver", PROMPTS[0], long):
            break
        for _ in range(200):
            if engine.num_running == 0:
                return
            await asyncio.sleep(0.05)

    asyncio.run(main())
    assert engine.num_running == 0


def test_failure_in_one_request_spares_the_others(engine: AsyncEngine,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Fault injection: text processing raises for one request only.
    outputs = engine._core.outputs
    real_process = outputs.process

    def process(seq):  # type: ignore[no-untyped-def]
        if seq.request_id == "doomed" and seq.num_output_tokens > 2:
            raise RuntimeError("detokenizer exploded")
        return real_process(seq)

    monkeypatch.setattr(outputs, "process", process)

    async def main() -> tuple[BaseException | list[TokenDelta], ...]:
        return tuple(await asyncio.gather(collect(engine, "doomed", PROMPTS[0], GREEDY),
                                          collect(engine, "fine", PROMPTS[2], GREEDY),
                                          return_exceptions=True))

    doomed, fine = asyncio.run(main())
    assert isinstance(doomed, EngineError) and "exploded" in str(doomed)
    assert isinstance(fine, list) and fine[-1].finish_reason == FinishReason.LENGTH
    monkeypatch.undo()
    after = asyncio.run(collect(engine, "after", PROMPTS[0], GREEDY))
    assert after[-1].finish_reason == FinishReason.LENGTH


def test_bad_input_raises_at_submission(engine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(InvalidRequestError, match="empty"):
            engine.generate("e1", "", GREEDY)
        with pytest.raises(InvalidRequestError, match="holds"):
            engine.generate("e2", [1] * 5000, GREEDY)
        stream = engine.generate("dup", PROMPTS[0], GREEDY)
        with pytest.raises(InvalidRequestError, match="already running"):
            engine.generate("dup", PROMPTS[0], GREEDY)
        assert (await anext_all(stream))[-1].finish_reason == FinishReason.LENGTH

    asyncio.run(main())


async def anext_all(stream: object) -> list[TokenDelta]:
    return [d async for d in stream]  # type: ignore[attr-defined]


def test_resume_streams_only_new_tokens(engine: AsyncEngine, llm: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, top_logprobs=5)
    full = llm.generate([PROMPTS[2]], params)[0]
    assert full.logprobs is not None
    k = 10
    deltas = asyncio.run(collect(engine, "resumed", PROMPTS[2], params,
                                 resume_token_ids=full.output_token_ids[:k]))
    new = [t for d in deltas for t in d.new_token_ids]
    assert len(new) == 24 - k  # the resumed tokens count towards max_tokens, not re-sent
    equal = assert_greedy_close(new, [lp.top for d in deltas for lp in (d.logprobs or [])],
                                full.output_token_ids[k:], [lp.top for lp in full.logprobs[k:]],
                                "resumed tokens are prefilled in one matmul, not decoded")
    text = "".join(d.new_text for d in deltas)
    if equal == len(new):
        assert full.text.endswith(text) and 0 < len(text) < len(full.text)
