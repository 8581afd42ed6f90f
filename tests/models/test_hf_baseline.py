"""The HF transformers baseline built from minimill's weights, and the FLOP yardsticks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from minimill.bench.hf_baseline import (
    build_hf_model,
    flops_per_token,
    hf_generate_throughput,
    measure_matmul_flops,
)
from minimill.models.types import LoadedModel

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_model(loaded_f32: LoadedModel) -> Any:
    return build_hf_model(loaded_f32, torch.float32)


def _prompt_ids(loaded: LoadedModel) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template(QUESTION))


def test_greedy_answer_is_sensible(hf_model: Any, loaded_f32: LoadedModel) -> None:
    ids = _prompt_ids(loaded_f32)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                dtype=torch.long), max_new_tokens=12, do_sample=False,
                                pad_token_id=2)
    answer = loaded_f32.tokenizer.decode(out[0, len(ids):].tolist())
    assert "Paris" in answer


def test_logits_match_transformers_own_gguf_model(hf_model: Any, loaded_f32: LoadedModel,
                                                  hf_gguf_model: Any) -> None:
    """Same config mapping as transformers' (rope theta, heads, eps, ties): same logits."""
    ids = torch.tensor([_prompt_ids(loaded_f32)])
    with torch.inference_mode():
        ours = hf_model(ids).logits
        theirs = hf_gguf_model(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_bfloat16_model_shares_the_engine_weights(loaded_f32: LoadedModel) -> None:
    model = build_hf_model(loaded_f32, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the file
    assert model.config._attn_implementation == "sdpa" and not model.training


def test_generate_throughput_honours_max_tokens(hf_model: Any, loaded_f32: LoadedModel) -> None:
    ids = _prompt_ids(loaded_f32)
    prompts = [ids, ids[:9], ids[3:]]
    result = hf_generate_throughput(hf_model, prompts, max_new_tokens=3, batch_size=2,
                                    pad_token_id=2)
    assert result["output_tokens"] == 9
    assert result["seconds"] > 0
    assert result["output_tok_s"] == pytest.approx(9 / result["seconds"])


def test_flops_per_token(loaded_f32: LoadedModel) -> None:
    c = loaded_f32.config
    assert flops_per_token(c) == 2 * c.num_params
    assert flops_per_token(c, context_len=100) == 2 * c.num_params + 4 * 30 * 9 * 64 * 100


def test_measure_matmul_flops_is_positive_and_plausible() -> None:
    flops = measure_matmul_flops(torch.float32, seconds=0.3)
    # Any CPU that runs the tests does more than 100 MFLOP/s and less than 100 TFLOP/s.
    assert 1e8 < flops < 1e14
