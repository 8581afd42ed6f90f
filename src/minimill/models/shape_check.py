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
    expected = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.layers.0.self_attn.q_proj.weight":
            (config.num_attention_heads * config.head_dim, config.hidden_size),
        "model.layers.0.self_attn.k_proj.weight":
            (config.num_key_value_heads * config.head_dim, config.hidden_size),
        "model.layers.0.mlp.up_proj.weight": (config.intermediate_size, config.hidden_size),
    }
    for key, shape in expected.items():
        got = tuple(weights[key].shape) if key in weights else None
        if got != shape:
            raise ModelFileError(f"{path}: tensor {key} has shape {got}, metadata implies {shape}")
    last = f"model.layers.{config.num_hidden_layers - 1}.mlp.down_proj.weight"
    if last not in weights:
        raise ModelFileError(f"{path}: {config.num_hidden_layers} layers declared, {last} missing")
