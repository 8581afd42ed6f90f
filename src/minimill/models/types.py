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


# Architectures the engine runs, by the name ModelConfig.architecture carries.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gpt_oss", "deepseek_v3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a decoder the engine runs (ARCHITECTURES), in HF naming.

    The fields past `eos_token_ids` describe what newer families add to the Llama layer;
    their defaults are the Llama layer."""

    architecture: str  # one of ARCHITECTURES
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
    # Qwen3, Gemma 3: an RMSNorm over each head's queries and keys before the rotary.
    qk_norm: bool = False
    # Gemma: norms scale by (1 + weight), and the attention and MLP outputs are normed too
    # (post_attention_layernorm / post_feedforward_layernorm) before the residual add.
    gemma_norms: bool = False
    hidden_act: str = "silu"  # "silu" or "gelu_tanh": the gate's activation
    # Gemma: embeddings are multiplied by sqrt(hidden_size).
    scale_embeddings: bool = False
    # Attention's score scale when it is not head_dim ** -0.5 (Gemma's query_pre_attn_scalar).
    attention_scale: float | None = None
    # Sliding-window layers attend to the last `sliding_window` positions (their own
    # included); `layer_types` says per layer "sliding" or "full" (empty: all full).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # The rotary base of sliding layers where it differs from rope_theta (Gemma 3), without
    # scaling.
    sliding_rope_theta: float | None = None
    # Mixture of experts (Qwen3-MoE): num_experts routed experts of moe_intermediate_size,
    # num_experts_per_tok of them per token, their weights renormalised to sum to 1 where
    # norm_topk_prob. Layers listed in dense_layers keep a dense MLP (of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: a bias on o_proj too, one attention-sink logit per head, and experts in its
    # own style ("gpt_oss": a router with bias whose top-k logits are softmaxed, experts with
    # biases and the clamped SwiGLU) rather than Qwen3's ("qwen3").
    o_proj_bias: bool = False
    attention_sinks: bool = False
    expert_style: str = "qwen3"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V3 experts (expert_style "deepseek_v3"): sigmoid scores plus a per-expert
    # correction bias pick the experts, first the best `topk_group` of `n_group` groups; the
    # chosen scores (renormalised where norm_topk_prob) times routed_scaling_factor weigh
    # them, and n_shared_experts experts' worth of an MLP every token runs is added.
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (DeepSeek-V3), on where kv_lora_rank > 0. Each token's keys
    # and values come from one latent of kv_lora_rank values (kv_a_proj_with_mqa, normed)
    # plus one qk_rope_head_dim rotary key shared by the heads: what the KV cache holds.
    # Queries go through a q_lora_rank bottleneck (None: one q_proj). head_dim is the rotary
    # part's width (qk_rope_head_dim), as in HF. rope_interleave: the checkpoint's rotary
    # dimensions are paired (0, 1), (2, 3), ... rather than (i, i + d / 2).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """What the KV cache holds per token and layer: (tensors, heads, values per head):
        K and V per kv head, or MLA's one latent (kv_lora_rank + qk_rope_head_dim values)."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_key_value_heads, self.head_dim

    def _attention_params(self) -> int:
        h, heads = self.hidden_size, self.num_attention_heads
        if not self.is_mla:
            q = heads * self.head_dim
            kv = self.num_key_value_heads * self.head_dim
            return h * q + 2 * h * kv + q * h
        qk = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        rank = self.kv_lora_rank
        q_params = (h * qk if self.q_lora_rank is None
                    else h * self.q_lora_rank + self.q_lora_rank * qk)
        kv_params = (h * (rank + self.qk_rope_head_dim)
                     + rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q_params + kv_params + heads * self.v_head_dim * h

    def _layer_params(self, layer: int, experts: int) -> int:
        h = self.hidden_size
        attention = self._attention_params()
        if self.is_moe(layer):
            mlp = h * self.num_experts + (experts + self.n_shared_experts) * 3 * h \
                * self.moe_intermediate_size
        else:
            mlp = 3 * h * self.intermediate_size
        return attention + mlp

    @property
    def num_params(self) -> int:
        """Parameters that take part in a forward pass (the lm_head counted once even if
        tied); for a mixture of experts, every expert (see num_active_params)."""
        return sum(self._layer_params(i, self.num_experts)
                   for i in range(self.num_hidden_layers)) + self.vocab_size * self.hidden_size

    @property
    def num_active_params(self) -> int:
        """Parameters one token passes through (a mixture of experts: its top-k experts)."""
        return sum(self._layer_params(i, self.num_experts_per_tok)
                   for i in range(self.num_hidden_layers)) + self.vocab_size * self.hidden_size


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


def kept_extra(weights: dict[str, torch.Tensor], shapes: dict[str, torch.Tensor]
               ) -> dict[str, Any]:
    """What a load records in `LoadedModel.extra` of the weights it read: every weight's shape
    as a meta tensor (`weight_shapes`, for planning the whole model when it kept only some)
    and the bytes it read (`loaded_bytes`)."""
    return {"weight_shapes": shapes,
            "loaded_bytes": sum(t.numel() * t.element_size() for t in weights.values())}
