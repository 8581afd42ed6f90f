"""Named model shapes with random weights: measure what a chip does with a model's shape
without fetching the model (`bench engine --shape llama3-8b --random-weights`).

The numbers a random-weight model produces are meaningless, but every matmul, attention and
KV byte is the real model's, so tokens/s are the model's. Prompts are tokenized with the
default model's tokenizer (its ids fit every vocabulary here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from minimill.models.tokenizer import Tokenizer
from minimill.models.types import LoadedModel, ModelConfig, ModelFileError

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
}


def shape_from_hf_config(path: Path) -> ModelConfig:
    """The shape an HF config.json describes (Llama / Mistral / Qwen2 families)."""
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: not a readable config.json: {exc}") from exc
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        model_type = str(raw.get("model_type", "llama"))
        return ModelConfig(
            architecture="qwen2" if model_type == "qwen2" else "llama",
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            rope_scaling=raw.get("rope_scaling"))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{path}: missing or bad field in config.json: {exc}") from exc


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
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def random_model(name: str, config: ModelConfig, dtype: torch.dtype, tokenizer: Tokenizer,
                 seed: int = 0) -> LoadedModel:
    """A LoadedModel of this shape with random weights (norms at 1, others ~N(0, 0.02)).

    The engine takes the weights over as it builds (`release_weights`), so a model that
    barely fits in memory is never held twice.
    """
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for weight_name, shape in weight_shapes(config).items():
        if weight_name.endswith("norm.weight"):
            weights[weight_name] = torch.ones(shape, dtype=dtype)
        else:
            tensor = torch.empty(shape, dtype=dtype)
            # In row blocks: a float32 temporary of a whole 128k x 4k matrix would be 2 GB.
            for start in range(0, shape[0], 4096):
                block = tensor[start:start + 4096]
                block.copy_(torch.randn(block.shape, generator=generator) * 0.02)
            weights[weight_name] = tensor
    return LoadedModel(name=name, config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=tokenizer.chat_template, source_path=f"random:{name}",
                       extra={"release_weights": True})
