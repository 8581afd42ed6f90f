"""The yardsticks the engine is measured against: HF transformers running the same weights,
and the matmul FLOP/s this machine achieves (the compute-bound speed of light)."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, cast

import torch

from minimill.models.types import LoadedModel, ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel


_LAYER_TYPES = {"sliding": "sliding_attention", "full": "full_attention"}


def hf_config(config: ModelConfig, dtype: torch.dtype) -> Any:
    import transformers as tf
    from transformers import LlamaConfig, Qwen2Config

    eos = list(config.eos_token_ids)
    common: dict[str, Any] = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, rope_theta=config.rope_theta,
        rope_scaling=dict(config.rope_scaling) if config.rope_scaling else None,
        bos_token_id=config.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos or None,
        hidden_act="silu", attn_implementation="sdpa", dtype=dtype,
    )
    arch = config.architecture
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(attention_bias=config.attention_bias, **common)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            attention_bias=config.attention_bias, num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob, mlp_only_layers=list(config.dense_layers),
            **common)
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(
            attention_bias=config.attention_bias, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
            rope_interleave=config.rope_interleave, n_routed_experts=config.num_experts,
            n_shared_experts=config.n_shared_experts,
            num_experts_per_tok=config.num_experts_per_tok, n_group=config.n_group,
            topk_group=config.topk_group, routed_scaling_factor=config.routed_scaling_factor,
            norm_topk_prob=config.norm_topk_prob,
            moe_intermediate_size=config.moe_intermediate_size,
            first_k_dense_replace=len(config.dense_layers), num_mtp_layers=0, **common)
    layer_types = [_LAYER_TYPES[t] for t in config.layer_types] or None
    if arch == "gpt_oss":
        common.pop("hidden_act")
        return tf.GptOssConfig(
            num_local_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
            sliding_window=config.sliding_window, layer_types=layer_types,
            swiglu_limit=config.swiglu_limit, **common)
    if arch == "gemma3":
        common.pop("hidden_act")
        common.pop("rope_theta")
        common.pop("rope_scaling")
        rope = {"full_attention": {"rope_type": "default", "rope_theta": config.rope_theta,
                                   **(config.rope_scaling or {})},
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": config.sliding_rope_theta or 10000.0}}
        assert config.attention_scale is not None
        return tf.Gemma3TextConfig(
            hidden_activation="gelu_pytorch_tanh", sliding_window=config.sliding_window,
            layer_types=layer_types, rope_parameters=rope,
            query_pre_attn_scalar=round(config.attention_scale ** -2), **common)
    return LlamaConfig(attention_bias=config.attention_bias, **common)


def hf_class(architecture: str) -> Any:
    import transformers as tf

    return {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
            "qwen3": tf.Qwen3ForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
            "gemma3": tf.Gemma3ForCausalLM, "gpt_oss": tf.GptOssForCausalLM,
            "deepseek_v3": tf.DeepseekV3ForCausalLM}[architecture]


def build_hf_model(loaded: LoadedModel, dtype: torch.dtype) -> PreTrainedModel:
    """transformers' model of the architecture, holding the engine's exact weights."""
    config = hf_config(loaded.config, dtype)
    if loaded.config.architecture in ("gemma3", "gpt_oss"):
        config._attn_implementation = "eager"  # transformers' own choice for these two
    cls = hf_class(loaded.config.architecture)
    # Built on CPU rather than on the meta device: rotary buffers are computed at construction,
    # in ways that vary across versions. Random init is skipped: assign=True swaps every
    # parameter for our tensor (no copy when the dtype already matches).
    with _no_init_weights():
        model = cls(config)
    weights = {name: w.to(dtype) for name, w in loaded.weights.items()}
    if any(name.endswith("experts.gate_up_proj") for name in model.state_dict()):
        weights = _fused_experts(weights, loaded.config)
    # strict=False only because a tied lm_head is absent from our weights; checked below.
    result = model.load_state_dict(weights, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if loaded.config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise ValueError(f"weights do not fit {cls.__name__}: missing {result.missing_keys}, "
                         f"unexpected {result.unexpected_keys}")
    if loaded.config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    return model


def _fused_experts(weights: dict[str, torch.Tensor], config: ModelConfig
                   ) -> dict[str, torch.Tensor]:
    """Qwen3-MoE's (and DeepSeek-V3's) per-expert checkpoint tensors as the [experts, ...]
    parameters transformers (>= 5) holds them in (its from_pretrained converts them the same
    way)."""
    if config.architecture not in ("qwen3_moe", "deepseek_v3"):
        return weights
    for layer in range(config.num_hidden_layers):
        if not config.is_moe(layer):
            continue
        p = f"model.layers.{layer}.mlp.experts."
        experts = range(config.num_experts)
        weights[p + "gate_up_proj"] = torch.stack([torch.cat(
            [weights.pop(f"{p}{e}.gate_proj.weight"), weights.pop(f"{p}{e}.up_proj.weight")])
            for e in experts])
        weights[p + "down_proj"] = torch.stack([weights.pop(f"{p}{e}.down_proj.weight")
                                                for e in experts])
    return weights


def _no_init_weights() -> contextlib.AbstractContextManager[Any]:
    import importlib

    # transformers >= 5 has it in `initialization`, 4.x in `modeling_utils`.
    for module_name in ("transformers.initialization", "transformers.modeling_utils"):
        factory = getattr(importlib.import_module(module_name), "no_init_weights", None)
        if factory is not None:
            return cast("contextlib.AbstractContextManager[Any]", factory())
    return contextlib.nullcontext()


def flops_per_token(config: ModelConfig, context_len: int = 0) -> float:
    """Forward FLOPs for one token: 2 per weight, plus attention over `context_len` tokens."""
    # QK^T and AV: each 2 * heads * head_dim FLOPs per context token per layer.
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    return 2.0 * config.num_active_params + attention * context_len


def measure_matmul_flops(dtype: torch.dtype, seconds: float = 3.0, m: int = 256, n: int = 1536,
                         k: int = 576) -> float:
    """Best achieved FLOP/s over matmuls shaped like batched decode ([m..4m] x [k,n], [n,k])."""
    shapes = [(tokens, kk, nn) for tokens in (m, 2 * m, 4 * m) for kk, nn in ((k, n), (n, k))]
    budget = seconds / len(shapes)
    best = 0.0
    with torch.inference_mode():
        for tokens, inner, outer in shapes:
            a = torch.randn(tokens, inner, dtype=dtype)
            b = torch.randn(inner, outer, dtype=dtype)
            torch.matmul(a, b)  # warm-up: kernel selection, page faults
            calls, start = 0, time.perf_counter()
            while True:
                torch.matmul(a, b)
                calls += 1
                elapsed = time.perf_counter() - start
                if elapsed >= budget:
                    break
            best = max(best, 2.0 * tokens * inner * outer * calls / elapsed)
    return best


def hf_generate_throughput(model: PreTrainedModel, prompt_token_ids: list[list[int]],
                           max_new_tokens: int, batch_size: int, pad_token_id: int
                           ) -> dict[str, Any]:
    """Greedy HF `generate` over the prompts in left-padded batches, exactly max_new_tokens each.

    Returns output_tokens, seconds and output_tok_s (generated tokens per wall second).
    """
    output_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompt_token_ids), batch_size):
            batch = prompt_token_ids[first:first + batch_size]
            width = max(len(ids) for ids in batch)
            input_ids = torch.tensor([[pad_token_id] * (width - len(ids)) + ids for ids in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
            out = model.generate(  # type: ignore[operator]
                input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
            output_tokens += (out.shape[1] - width) * len(batch)
    seconds = time.perf_counter() - start
    return {"output_tokens": output_tokens, "seconds": seconds,
            "output_tok_s": output_tokens / seconds if seconds > 0 else 0.0}
