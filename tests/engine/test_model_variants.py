"""Architecture variants against HF transformers on small random models: every RoPE scaling
type, Qwen2's q/k/v biases, untied embeddings (float32)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from engine_helpers import assert_greedy_close, assert_logits_match

from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
from minimill.engine.rope import inv_freq_and_scale
from minimill.models.types import LoadedModel, ModelConfig

VOCAB = 49152  # the default model's tokenizer, so the engine can run these models end to end
ORIGINAL_LEN = 16  # prompts run past it, so the scaling takes effect
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama3-untied": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": ORIGINAL_LEN},
                      "tie_word_embeddings": False},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": ORIGINAL_LEN}},
    "qwen2": {"architecture": "qwen2", "tie_word_embeddings": False},
}


def build_variant(name: str, tokenizer: Any) -> tuple[LoadedModel, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(VARIANTS[name])
    arch = spec.pop("architecture", "llama")
    common: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "initializer_range": 0.2, **spec}
    torch.manual_seed(0)
    if arch == "qwen2":
        hf = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    else:
        hf = LlamaForCausalLM(LlamaConfig(**common)).eval()
    config = ModelConfig(
        architecture=arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
        tie_word_embeddings=common["tie_word_embeddings"], attention_bias=arch == "qwen2",
        rope_scaling=spec.get("rope_scaling"), eos_token_ids=(2,))
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    loaded = LoadedModel(name=f"tiny-{name}", config=config, weights=weights,
                         tokenizer=tokenizer, chat_template=None)
    return loaded, hf


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_hf(name: str, smol_f32: LoadedModel) -> None:
    loaded, hf = build_variant(name, smol_f32.tokenizer)
    llm = LLM(loaded, dtype="float32", num_kv_blocks=64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (45, 23)]
    assert_logits_match(llm, hf, prompts, name)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, top_logprobs=5)
    out = llm.generate([prompts[0]], params)[0]
    with torch.inference_mode():
        gen = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    ref_top = []
    for step in gen.logits:
        values, ids = torch.log_softmax(step[0], -1).topk(5)
        ref_top.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
    assert out.logprobs is not None
    assert_greedy_close(out.output_token_ids, [lp.top for lp in out.logprobs],
                        gen.sequences[0, len(prompts[0]):].tolist(), ref_top,
                        "the engine's matmul and attention shapes differ from HF's")


@pytest.mark.parametrize("name", [n for n in VARIANTS if "rope_scaling" in VARIANTS[n]])
def test_inverse_frequencies_match_hf(name: str, smol_f32: LoadedModel) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    loaded, hf = build_variant(name, smol_f32.tokenizer)
    rope_type = VARIANTS[name]["rope_scaling"]["rope_type"]
    ref_inv_freq, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](hf.config, torch.device("cpu"))
    ours, scale = inv_freq_and_scale(loaded.config, max_model_len=128)
    torch.testing.assert_close(ours, ref_inv_freq.float(), rtol=1e-6, atol=0)
    assert math.isclose(scale, float(ref_scale), rel_tol=1e-9)
