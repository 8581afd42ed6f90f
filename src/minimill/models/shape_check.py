"""Whether a model's tensors have the shapes its config implies: a mismatch found at load time
names the file, where the engine would fail far from the cause."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from minimill.models.types import ModelConfig, ModelFileError

if TYPE_CHECKING:
    import torch


def check_shapes(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Metadata and tensors must agree, or the engine would fail far from the cause."""
    expected: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    if config.is_mla:  # one latent and one rotary key per token, read by every head
        expected["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] = (
            config.kv_lora_rank + config.qk_rope_head_dim, config.hidden_size)
        expected["model.layers.0.self_attn.kv_b_proj.weight"] = (
            config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim),
            config.kv_lora_rank)
    else:
        expected["model.layers.0.self_attn.q_proj.weight"] = (
            config.num_attention_heads * config.head_dim, config.hidden_size)
        expected["model.layers.0.self_attn.k_proj.weight"] = (
            config.num_key_value_heads * config.head_dim, config.hidden_size)
    if config.expert_style == "gpt_oss" and config.is_moe(0):
        expected[_mlp(config, 0, "gate_up_proj")] = (
            config.num_experts, config.hidden_size, 2 * config.moe_intermediate_size)
    else:
        expected[_mlp(config, 0, "up_proj")] = (
            config.moe_intermediate_size if config.is_moe(0) else config.intermediate_size,
            config.hidden_size)
    for key, shape in expected.items():
        got = tuple(weights[key].shape) if key in weights else None
        if got != shape:
            raise ModelFileError(f"{path}: tensor {key} has shape {got}, metadata implies {shape}")
    last = _mlp(config, config.num_hidden_layers - 1, "down_proj")
    if last not in weights:
        raise ModelFileError(f"{path}: {config.num_hidden_layers} layers declared, {last} missing")


def _mlp(config: ModelConfig, layer: int, projection: str) -> str:
    """A layer's MLP weight: of its last expert where the layer is a mixture of experts."""
    if config.is_moe(layer) and config.expert_style == "gpt_oss":  # experts stacked
        return f"model.layers.{layer}.mlp.experts.{projection}"
    if config.is_moe(layer):
        return f"model.layers.{layer}.mlp.experts.{config.num_experts - 1}.{projection}.weight"
    return f"model.layers.{layer}.mlp.{projection}.weight"
