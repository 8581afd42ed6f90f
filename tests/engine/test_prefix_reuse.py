"""Prefix reuse across requests: a shared system prompt in one batch, and a conversation's next
turn reusing the previous turn's blocks (its generated tokens included). Hits must give the
greedy tokens of a cold run (float32 KV), and each request says how many prompt tokens were
served from the cache."""

from __future__ import annotations

import pytest
import torch

from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
from minimill.models.types import LoadedModel

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BS = 16


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def cold(smol_f32: LoadedModel) -> LLM:
    return LLM(smol_f32, dtype="float32", num_kv_blocks=256, max_model_len=1024,
               enable_prefix_caching=False)


def test_shared_prefix_in_one_batch_is_computed_once(llm: LLM, cold: LLM) -> None:
    system = _tokens(11, 4 * BS)
    prompts = [[*system, *_tokens(20 + i, 9)] for i in range(4)]
    hot = llm.generate(prompts, GREEDY)
    # The first computes the shared blocks; the others wait a step and find them cached.
    assert [o.num_cached_tokens for o in hot] == [0, 4 * BS, 4 * BS, 4 * BS]
    reference = cold.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in hot] == [o.output_token_ids for o in reference]
    assert all(o.num_cached_tokens == 0 for o in reference)


def test_next_turn_reuses_the_previous_turns_generated_blocks(llm: LLM, cold: LLM) -> None:
    turn1 = _tokens(31, 40)
    first = llm.generate([turn1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    history = [*turn1, *first.output_token_ids]  # 50 tokens: 3 full blocks computed
    turn2 = [*history, *_tokens(32, 40)]
    second = llm.generate([turn2], GREEDY)[0]
    # Blocks holding generated tokens are reused too (the 3rd block ends in turn 1's output).
    assert second.num_cached_tokens == 3 * BS > len(turn1)
    assert second.output_token_ids == cold.generate([turn2], GREEDY)[0].output_token_ids
