"""The engine against HF transformers on the same weights (default model, float32)."""

from __future__ import annotations

from typing import Any

import torch
from engine_helpers import PROMPTS, assert_greedy_close, engine_logits

from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, top_logprobs=5)
WHY = ("the engine's attention and matmul shapes differ from HF's, so float32 sums are "
       "ordered differently and a near-tie between the two best tokens can flip")


def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    per_position = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    return float(per_position.max())


def test_logits_match_hf_batched_and_chunked(llm: LLM, hf_model: Any) -> None:
    prompts = [llm.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    refs = [hf_logits(hf_model, p) for p in prompts]
    for ours, ref in zip(engine_logits(llm, prompts), refs, strict=True):
        assert ours.shape == ref.shape
        assert relative_error(ours, ref) < 1e-3
    # The same with each prompt's tail computed against its head in the paged cache.
    for ours, ref in zip(engine_logits(llm, prompts, chunk=5), refs, strict=True):
        assert relative_error(ours, ref) < 1e-3


def hf_greedy(hf_model: Any, ids: list[int], max_new_tokens: int
              ) -> tuple[list[int], list[list[tuple[int, float]]]]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                dtype=torch.long), max_new_tokens=max_new_tokens,
                                do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=2)
    tokens = out.sequences[0, len(ids):].tolist()
    tops = []
    for step_logits in out.logits:
        values, indices = torch.log_softmax(step_logits[0].float(), -1).topk(5)
        tops.append(list(zip(indices.tolist(), values.tolist(), strict=True)))
    return tokens, tops


def test_greedy_64_tokens_match_hf(llm: LLM, hf_model: Any) -> None:
    prompts = [llm.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS[:3]]
    outs = llm.generate(prompts, GREEDY_64)
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_top = hf_greedy(hf_model, prompt, 64)
        assert out.logprobs is not None
        ours_top = [lp.top for lp in out.logprobs]
        equal = assert_greedy_close(out.output_token_ids, ours_top, ref_tokens, ref_top, WHY)
        assert equal >= 32, f"only {equal} tokens equal before a near-tie"
