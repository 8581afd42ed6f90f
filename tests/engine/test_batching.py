"""Results do not depend on what else is in the batch, on chunking, on the prefix cache, or on
preemption when KV memory runs short (default model, float32): the same tokens and the same
logprobs, bit for bit. The engine's kernels are batch-invariant: a row's numbers never depend
on the other rows of its step, nor on whether it is computed in a prompt chunk or a decode."""

from __future__ import annotations

import pytest
from engine_helpers import PROMPTS

from minimill.engine.llm import LLM
from minimill.engine.params import RequestOutput, SamplingParams
from minimill.models.types import LoadedModel

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, top_logprobs=5)


def assert_identical(out: RequestOutput, ref: RequestOutput) -> None:
    assert out.output_token_ids == ref.output_token_ids
    assert top(out) == top(ref)


def top(out: RequestOutput) -> list[list[tuple[int, float]]]:
    assert out.logprobs is not None
    return [lp.top for lp in out.logprobs]


@pytest.fixture(scope="module")
def mixed_prompts(llm: LLM) -> list[list[int]]:
    """64 prompts from 3 to 100 tokens long."""
    words = ("the engine schedules requests in batches while the cache keeps keys and values "
             "for every token so that decoding stays cheap and throughput stays high").split()
    prompts = []
    for i in range(64):
        n = 3 + (i * 37) % 97
        text = " ".join(words[(i + j) % len(words)] for j in range(n))
        prompts.append(llm.tokenizer.encode(text)[:n])
    return prompts


@pytest.fixture(scope="module")
def alone(llm: LLM) -> RequestOutput:
    # Longer than a KV block, so a second run can find it in the prefix cache.
    prompt = llm.tokenizer.encode(PROMPTS[3], add_special_tokens=True)
    assert len(prompt) > 16
    return llm.generate([prompt], GREEDY)[0]


def test_same_tokens_alone_and_inside_a_batch_of_64(llm: LLM, alone: RequestOutput,
                                                    mixed_prompts: list[list[int]]) -> None:
    batch = [*mixed_prompts[:31], alone.prompt_token_ids, *mixed_prompts[31:63]]
    outs = llm.generate(batch, GREEDY)
    assert len(outs) == 64
    assert all(len(o.output_token_ids) > 0 for o in outs)
    inside = outs[31]
    assert inside.prompt_token_ids == alone.prompt_token_ids
    assert_identical(inside, alone)


def test_chunked_prefill_and_prefix_cache_give_the_same_tokens(
        smol_f32: LoadedModel, alone: RequestOutput) -> None:
    small_chunks = LLM(smol_f32, dtype="float32", num_kv_blocks=256, max_model_len=1024,
                       max_num_batched_tokens=4, max_num_seqs=1)
    first = small_chunks.generate([alone.prompt_token_ids], GREEDY)[0]
    # The second run finds the prompt's full blocks in the prefix cache.
    second = small_chunks.generate([alone.prompt_token_ids], GREEDY)[0]
    for out in (first, second):
        assert_identical(out, alone)
    assert small_chunks.engine.scheduler.num_cached_tokens_total > 0


def test_preemption_when_kv_is_short_still_finishes_everything(
        smol_f32: LoadedModel, llm: LLM, mixed_prompts: list[list[int]]) -> None:
    prompts = mixed_prompts[:8]
    params = SamplingParams(max_tokens=32, temperature=0.0, top_logprobs=5, ignore_eos=True)
    reference = llm.generate(prompts, params)
    # 16 blocks of 16 tokens: fewer than the 8 requests need together.
    need = sum(-(-(len(p) + 32) // 16) for p in prompts)
    assert need > 16
    tight = LLM(smol_f32, dtype="float32", num_kv_blocks=16, enable_prefix_caching=False)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outs, reference, strict=True):
        assert out.finish_reason is not None and len(out.output_token_ids) == 32
        assert_identical(out, ref)
    assert tight.engine.scheduler.block_manager.num_free_blocks == 16
