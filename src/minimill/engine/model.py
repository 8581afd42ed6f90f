"""Llama / Qwen2 decoder over flattened tokens with a paged KV cache.

Weights arrive in HF naming and are fused at load: q/k/v into one matrix (plus bias for
Qwen2), gate/up into one, so each layer runs four matmuls. Activations are
[num_tokens, hidden] for the whole step (every request's new tokens back to back); positions
and the attention metadata say where each token sits. Arithmetic follows HF transformers
(norms in float32, residuals in the model dtype) so float32 runs match it closely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minimill.engine.attention import AttentionMetadata, paged_attention, write_kv
from minimill.engine.rope import RotaryEmbedding, apply_rotary
from minimill.models.types import ModelConfig, ModelFileError


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF: normalise in float32, round to the model dtype, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DecoderModel:
    """The forward pass; owns the fused weights and the rotary tables."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device, max_model_len: int) -> None:
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim ** -0.5

        def w(name: str) -> torch.Tensor:
            tensor = weights.get(name)
            if tensor is None:
                raise ModelFileError(f"weight {name!r} is missing from the model")
            return tensor.to(device=device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            bias = None
            if config.attention_bias:
                bias = torch.cat([w(a + f"{n}_proj.bias") for n in "qkv"]).contiguous()
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=torch.cat([w(a + f"{n}_proj.weight") for n in "qkv"]).contiguous(),
                qkv_bias=bias,
                o=w(a + "o_proj.weight").contiguous(),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([w(m + "gate_proj.weight"),
                                   w(m + "up_proj.weight")]).contiguous(),
                down=w(m + "down_proj.weight").contiguous(),
            ))
        self.rotary = RotaryEmbedding(config, max_model_len, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_cache: [layers, kv_heads, blocks,
        block_size, 2, head_dim]; returns logits [len(logits_rows), vocab] in the model dtype."""
        num_tokens = input_ids.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        cos, sin = self.rotary.tables(positions)
        hidden = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        for i, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, self.eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            # q and k heads side by side: one rotary pass for both.
            qk = qkv[:, :q_size + kv_size].view(num_tokens, -1, self.head_dim)
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
            write_kv(kv_cache[i], k, v, meta.slot_mapping)
            attn = paged_attention(q, kv_cache[i], meta, self.scale)
            hidden = hidden + F.linear(attn, layer.o)
            x = rms_norm(hidden, layer.post_norm, self.eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down)
        # Only the rows that sample need the final norm and the (large) vocabulary projection.
        last = rms_norm(hidden[logits_rows], self.norm, self.eps)
        return F.linear(last, self.lm_head)
