"""Tiny random checkpoints of every architecture the engine runs, built with transformers
and saved as HF directories (config.json, safetensors, the default model's tokenizer): no
download, and transformers' model over the same weights is the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from minimill.models.types import LoadedModel

VOCAB = 49152  # the default model's tokenizer, so the engine runs these models end to end
WINDOW = 8  # Gemma 3's sliding window here: the test prompts run well past it

COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2,
    # A multiple of 32, so that the compiled CPU kernels run these models too.
    "head_dim": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
    "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen3": {"tie_word_embeddings": False},
    "gemma3": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
                  "norm_topk_prob": True, "mlp_only_layers": [1]},
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 3, "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                # Low enough that random activations reach the clamp.
                "swiglu_limit": 1.0},
}

# Architectures with tests of their own (not parametrized over with the ones above).
DEEPSEEK_V3: dict[str, Any] = {
    # MLA: a query bottleneck (None: one q_proj), a latent of 32 + a shared rotary key of 16.
    "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16, "head_dim": 16, "v_head_dim": 24,
    # YaRN with mscale_all_dim: scales the rotary and the softmax.
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 64, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    # The first layer dense; 8 routed experts in 2 groups, one group and 2 experts per token,
    # and one shared expert.
    "first_k_dense_replace": 1, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 48,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_mtp_layers": 0,
}
MORE_ARCHITECTURES: dict[str, dict[str, Any]] = {"deepseek_v3": DEEPSEEK_V3, "llama": {}}


def _classes(arch: str) -> tuple[Any, Any]:
    import transformers as tf

    return {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
            "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
            "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
            "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
            "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[arch]


def save_tiny(arch: str, directory: Path, tokenizer_from: LoadedModel, seed: int = 0,
              **overrides: Any) -> Any:
    """Save a random `arch` checkpoint in `directory` (its config with `overrides`); returns
    transformers' model of it."""
    config_cls, model_cls = _classes(arch)
    torch.manual_seed(seed)
    settings = {**COMMON, **(ARCHITECTURES.get(arch) or MORE_ARCHITECTURES[arch]), **overrides}
    config = config_cls(**settings)
    # transformers' own choice for these two (sinks need eager; Gemma recommends it).
    config._attn_implementation = "eager" if arch in ("gemma3", "gpt_oss") else "sdpa"
    model = model_cls(config).eval()
    with torch.no_grad():
        # Norms start at 1 (Gemma: at 0, scaled by 1 + w): random ones catch a norm applied
        # the wrong way.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand_like(param) * 0.5 + 0.75
                            - (1.0 if arch == "gemma3" else 0.0))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek: zero would hide it
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    model.save_pretrained(directory, max_shard_size="2MB")
    tokenizer_from.tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
         "chat_template": tokenizer_from.chat_template}))
    return model


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int
              ) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """transformers' greedy tokens and each step's top-5 logprobs."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    tops = []
    for step in out.logits:
        values, ids = torch.log_softmax(step[0].float(), -1).topk(5)
        tops.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
    return out.sequences[0, len(prompt):].tolist(), tops
