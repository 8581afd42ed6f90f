"""Named model shapes with random weights: measure what a chip does with a model's shape
without fetching the model (`bench engine --shape llama3-8b --random-weights`).

The numbers a random-weight model produces are meaningless, but every matmul, attention and
KV byte is the real model's, so tokens/s are the model's. Prompts are tokenized with the
default model's tokenizer (its ids fit every vocabulary here).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minimill.models.hf_config import HF_ARCHITECTURES, config_from_hf, mla_scale
from minimill.models.tokenizer import Tokenizer
from minimill.models.types import LoadedModel, ModelConfig, ModelFileError

# What DeepSeek-V3's layers share whatever their width: MLA's dimensions, the routing.
_DEEPSEEK_V3_MLA: dict[str, Any] = dict(
    architecture="deepseek_v3", num_attention_heads=128, num_key_value_heads=128, head_dim=64,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=163840,
    tie_word_embeddings=False,
    rope_scaling={"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                  "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096},
    attention_scale=mla_scale(192, {"rope_type": "yarn", "factor": 40.0,
                                    "mscale_all_dim": 1.0}),
    kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, rope_interleave=True, num_experts_per_tok=8, expert_style="deepseek_v3",
    n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5)

NAMED_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True),
    "llama3-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_word_embeddings=False),
    "qwen2.5-7b": ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=False, attention_bias=True),
    "llama3-70b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_word_embeddings=False),
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True, qk_norm=True),
    "qwen3-8b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=False, qk_norm=True),
    # Qwen3-30B-A3B's layer (128 experts, top-8) at half the width, a quarter of the experts
    # and half the depth: 2.9B parameters with both embeddings (5.7 GB in bf16), 0.7B of them
    # active per token.
    "qwen3-moe-2.9b-a0.7b": ModelConfig(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=False, qk_norm=True, num_experts=64, num_experts_per_tok=8,
        moe_intermediate_size=512, norm_topk_prob=True),
    "qwen3-30b-a3b": ModelConfig(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=False, qk_norm=True, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True),
    "gemma3-1b": ModelConfig(
        architecture="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=True, qk_norm=True, gemma_norms=True, hidden_act="gelu_tanh",
        scale_embeddings=True, attention_scale=256 ** -0.5, sliding_window=512,
        layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(26)),
        sliding_rope_theta=10000.0),
    "gpt-oss-20b": ModelConfig(
        architecture="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072,
        tie_word_embeddings=False, attention_bias=True,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                      "truncate": False},
        sliding_window=128,
        layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(24)),
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880,
        o_proj_bias=True, attention_sinks=True, expert_style="gpt_oss"),
    # DeepSeek-V3 (and Kimi K2, with 384 experts): 671B parameters with the MTP layer, which
    # the engine does not run; too big for most single machines, here for its arithmetic.
    "deepseek-v3": ModelConfig(**_DEEPSEEK_V3_MLA, vocab_size=129280, hidden_size=7168,
                               intermediate_size=18432, num_hidden_layers=61,
                               num_experts=256, moe_intermediate_size=2048,
                               dense_layers=(0, 1, 2)),
    # DeepSeek-V3's attention exactly (so its KV bytes per token and layer are the real ones:
    # a latent of 512 + 64 values where 128 heads would cache 40,960) in 4 layers of a
    # narrower model with fewer, smaller experts (first layer dense, top-8 of 32 in 8 groups).
    "deepseek-v3-mla-4l": ModelConfig(**_DEEPSEEK_V3_MLA, vocab_size=129280,
                                      hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=4, num_experts=32,
                                      moe_intermediate_size=256, dense_layers=(0,)),
}


# HF model_type values that are not the architecture's own name here.
_MODEL_TYPES = {"mistral": "llama", "gemma3_text": "gemma3"}


def shape_from_hf_config(path: Path) -> ModelConfig:
    """The shape an HF config.json describes (any architecture hf_config.py knows)."""
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: not a readable config.json: {exc}") from exc
    if not raw.get("architectures"):  # a bare shape: its model_type says which
        model_type = raw.get("model_type") or "llama"
        names = [name for name, arch in HF_ARCHITECTURES.items()
                 if arch == _MODEL_TYPES.get(model_type, model_type)]
        if not names:
            raise ModelFileError(
                f"{path}: model_type {model_type!r} not supported (supported: "
                f"{', '.join(sorted(set(HF_ARCHITECTURES.values()) | set(_MODEL_TYPES)))})")
        raw["architectures"] = names[:1]
    return config_from_hf(raw, path)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of the architecture, HF naming, with its shape."""
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        if config.is_mla:
            shapes.update(_mla_shapes(config, p + "self_attn."))
        else:
            shapes.update({
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            })
        if config.is_moe(layer) and config.expert_style == "deepseek_v3":
            e, m = config.num_experts, config.moe_intermediate_size
            x = p + "mlp."
            shapes.update({x + "gate.weight": (e, h), x + "gate.e_score_correction_bias": (e,)})
            for expert in range(e):
                y = f"{x}experts.{expert}."
                shapes.update({y + "gate_proj.weight": (m, h), y + "up_proj.weight": (m, h),
                               y + "down_proj.weight": (h, m)})
            shared = m * config.n_shared_experts
            if shared:
                y = x + "shared_experts."
                shapes.update({y + "gate_proj.weight": (shared, h),
                               y + "up_proj.weight": (shared, h),
                               y + "down_proj.weight": (h, shared)})
        elif config.is_moe(layer) and config.expert_style == "gpt_oss":
            e, m = config.num_experts, config.moe_intermediate_size
            x = p + "mlp."
            shapes.update({x + "router.weight": (e, h), x + "router.bias": (e,),
                           x + "experts.gate_up_proj": (e, h, 2 * m),
                           x + "experts.gate_up_proj_bias": (e, 2 * m),
                           x + "experts.down_proj": (e, m, h),
                           x + "experts.down_proj_bias": (e, h)})
        elif config.is_moe(layer):
            e, m = config.num_experts, config.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (e, h)
            for expert in range(e):
                x = f"{p}mlp.experts.{expert}."
                shapes.update({x + "gate_proj.weight": (m, h), x + "up_proj.weight": (m, h),
                               x + "down_proj.weight": (h, m)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                           p + "mlp.down_proj.weight": (h, i)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (config.head_dim,),
                           p + "self_attn.k_norm.weight": (config.head_dim,)})
        if config.gemma_norms:
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,),
                           p + "post_feedforward_layernorm.weight": (h,)})
        if config.attention_bias and not config.is_mla:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.attention_sinks:
            shapes[p + "self_attn.sinks"] = (config.num_attention_heads,)
    return shapes


def _mla_shapes(config: ModelConfig, a: str) -> dict[str, tuple[int, ...]]:
    """One layer's multi-head latent attention weights under `a` ("...self_attn.")."""
    h, heads, rank = config.hidden_size, config.num_attention_heads, config.kv_lora_rank
    qk = heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    shapes: dict[str, tuple[int, ...]] = {
        a + "kv_a_proj_with_mqa.weight": (rank + config.qk_rope_head_dim, h),
        a + "kv_a_layernorm.weight": (rank,),
        a + "kv_b_proj.weight": (heads * (config.qk_nope_head_dim + config.v_head_dim), rank),
        a + "o_proj.weight": (h, heads * config.v_head_dim)}
    if config.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (qk, h)
    else:
        shapes.update({a + "q_a_proj.weight": (config.q_lora_rank, h),
                       a + "q_a_layernorm.weight": (config.q_lora_rank,),
                       a + "q_b_proj.weight": (qk, config.q_lora_rank)})
    if config.attention_bias:  # (o_proj's bias is o_proj_bias's)
        shapes[a + "kv_a_proj_with_mqa.bias"] = (rank + config.qk_rope_head_dim,)
        if config.q_lora_rank is not None:
            shapes[a + "q_a_proj.bias"] = (config.q_lora_rank,)
    return shapes


def random_model(name: str, config: ModelConfig, dtype: torch.dtype, tokenizer: Tokenizer,
                 seed: int = 0, keep: Callable[[str], bool] | None = None) -> LoadedModel:
    """A LoadedModel of this shape with random weights (norms at 1, others ~N(0, 0.02)).

    The engine takes the weights over as it builds (`release_weights`), so a model that
    barely fits in memory is never held twice. `keep`: only the weights it names (an
    expert-parallel rank's share); every weight is drawn all the same, so that those kept
    are the same as in the whole model of this seed.
    """
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for weight_name, shape in weight_shapes(config).items():
        if weight_name.endswith("norm.weight"):
            # Gemma's norms scale by (1 + weight): 0 there is the same unit norm.
            weights[weight_name] = torch.full(shape, 0.0 if config.gemma_norms else 1.0,
                                              dtype=dtype)
        else:
            kept = keep is None or keep(weight_name)
            tensor = torch.empty(shape if kept else (0,), dtype=dtype)
            # In row blocks: a float32 temporary of a whole 128k x 4k matrix would be 2 GB.
            for start in range(0, shape[0], 4096):
                rows = torch.randn((min(4096, shape[0] - start), *shape[1:]),
                                   generator=generator)
                if kept:  # (a weight not kept is drawn all the same: the next ones follow)
                    tensor[start:start + 4096].copy_(rows * 0.02)
            if kept:
                weights[weight_name] = tensor
    if keep is not None:
        weights = {n: t for n, t in weights.items() if keep(n)}
    return LoadedModel(name=name, config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=tokenizer.chat_template, source_path=f"random:{name}",
                       extra={"release_weights": True, "random_seed": seed})
