"""Llama / Qwen2 decoder over flattened tokens with a paged KV cache.

Weights arrive in HF naming and are fused at load: q/k/v into one matrix (plus bias for
Qwen2), gate/up into one, so each layer runs four matmuls; everything between them (norms with
the residual add, rotary with the KV write, attention, SiLU * up) is one call each into the
engine's kernels (kernels.py). Activations are [num_tokens, hidden] for the whole step (every
request's new tokens back to back); positions and the attention metadata say where each token
sits. Arithmetic follows HF transformers (norms in float32, residuals in the model dtype) so
float32 runs match it closely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minimill.engine.attention import AttentionMetadata, layer_views
from minimill.engine.kernels import TorchKernels
from minimill.engine.kv_int4 import stage_layer_views
from minimill.engine.rope import RotaryEmbedding
from minimill.models.types import ModelConfig, ModelFileError


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # Matrices are as kernels.prepare_weight left them (e.g. prepacked for oneDNN).
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class DecoderModel:
    """The forward pass; owns the fused weights and the rotary tables."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device, max_model_len: int,
                 kernels: TorchKernels | None = None, release_weights: bool = False) -> None:
        """`release_weights`: take each weight out of `weights` once used, so that a model
        which barely fits in memory is never held twice (source and fused copies)."""
        self.config = config
        self.kernels = kernels or TorchKernels()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim ** -0.5

        def w(name: str) -> torch.Tensor:
            tensor = weights.pop(name, None) if release_weights else weights.get(name)
            if tensor is None:
                raise ModelFileError(f"weight {name!r} is missing from the model")
            return tensor.to(device=device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        pack = self.kernels.prepare_weight
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            # Packing may copy the embedding: the lm_head then holds its own layout.
            head = self.embed
        else:
            head = w("lm_head.weight")
        self.logits_width = head.shape[0]
        self.lm_head = pack(head)
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            bias = None
            if config.attention_bias:
                bias = torch.cat([w(a + f"{n}_proj.bias") for n in "qkv"]).contiguous()
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=pack(torch.cat([w(a + f"{n}_proj.weight") for n in "qkv"])),
                qkv_bias=bias,
                o=pack(w(a + "o_proj.weight")),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=pack(torch.cat([w(m + "gate_proj.weight"), w(m + "up_proj.weight")])),
                down=pack(w(m + "down_proj.weight")),
            ))
        self.rotary = RotaryEmbedding(config, max_model_len, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor,
                logits_rows: torch.Tensor, hidden_only: bool = False) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_cache: the pool (attention.py's layout);
        returns logits [len(logits_rows), vocab] in the model dtype, or with `hidden_only`
        those rows' final normed hidden states [len(logits_rows), hidden] (what embeddings
        pool; `project` turns them into logits)."""
        ops, eps = self.kernels, self.eps
        cos_sin = self.rotary.cos_sin
        hidden = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        residual = hidden
        for i, layer in enumerate(self.layers):
            if i == 0:
                x = ops.rms_norm(hidden, layer.input_norm, eps)
            else:
                x, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, eps)
            qkv = ops.linear(x, layer.qkv, layer.qkv_bias)
            k_cache, v_cache = layer_views(kv_cache, i)
            if meta.int4 is not None:
                k_stage, v_stage = stage_layer_views(meta.int4.kv_stage, i)
                q, k_new, v_new = ops.rotary_kv_write_int4(
                    qkv, positions, cos_sin, k_cache, v_cache, k_stage, v_stage, meta,
                    self.num_heads, self.num_kv_heads)
                attn = ops.paged_attention_int4(q, k_new, v_new, k_cache, v_cache, k_stage,
                                                v_stage, meta, self.scale)
            else:
                q = ops.rotary_kv_write(qkv, positions, cos_sin, k_cache, v_cache,
                                        meta.slot_mapping, self.num_heads, self.num_kv_heads,
                                        meta.block_size)
                attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)
            hidden = ops.linear(attn, layer.o)
            x, residual = ops.add_rms_norm(hidden, residual, layer.post_norm, eps)
            hidden = ops.linear(ops.silu_and_mul(ops.linear(x, layer.gate_up)), layer.down)
        # Only the rows that sample need the final norm and the (large) vocabulary projection
        # (none in a step of prompt chunks that all end before their prompt does).
        if not logits_rows.numel():
            return hidden.new_empty(0, self.logits_width)
        if not self.layers:
            last = ops.rms_norm(hidden[logits_rows], self.norm, eps)
        else:
            last = ops.rms_norm(hidden[logits_rows] + residual[logits_rows], self.norm, eps)
        return last if hidden_only else self.project(last)

    def project(self, last: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states [rows, hidden] -> logits [rows, vocab]."""
        return self.kernels.linear(last, self.lm_head)
