"""Plain data that a loaded model hands to the engine; no torch modules here, only tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# Re-exported: callers import the model errors with the types they concern.
from minimill.models.errors import ModelError as ModelError
from minimill.models.errors import ModelFileError as ModelFileError
from minimill.models.errors import ModelNotPulledError as ModelNotPulledError
from minimill.models.errors import UnknownModelError as UnknownModelError

if TYPE_CHECKING:
    import torch

    from minimill.models.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family or Qwen2-family decoder, in HF naming."""

    architecture: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen2 has biases on q/k/v projections; Llama does not.
    attention_bias: bool = False
    # HF-style rope_scaling dict ({"rope_type": "llama3"|"linear"|"dynamic"|"yarn", ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    # Every id that ends generation (the tokenizer's eos plus chat end-of-turn ids).
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_params(self) -> int:
        """Parameters that take part in a forward pass (the lm_head counted once even if tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
        return self.num_hidden_layers * per_layer + v * h


@dataclass(slots=True)
class LoadedModel:
    """Weights in HF parameter naming (e.g. `model.layers.0.self_attn.q_proj.weight`)."""

    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    chat_template: str | None
    source_path: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
