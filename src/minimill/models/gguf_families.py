"""What GGUF files of Gemma 3 (`gemma3`) and gpt-oss (`gpt-oss`) say beyond the Llama
layer: their ModelConfig fields, their tensor names, and how their tensors are turned back
into HF's layout.

llama.cpp's converters write what its own runtime fixes by architecture without a key: Gemma 3's
every-sixth global layer, its sliding layers' rotary base 10000 and attention scale, gpt-oss's
alternating layers and its SwiGLU constants. Those are read from the file where a key says them,
else taken as llama.cpp takes them.
"""

from __future__ import annotations

from typing import Any

import torch

from minimill.models.types import ModelFileError

# GGUF layer tensor parts whose HF name differs from the Llama layer's, by architecture.
LAYER_NAMES: dict[str, dict[str, str]] = {
    "gemma3": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    # gpt-oss's norm before the experts is HF's post_attention_layernorm; experts stay stacked
    # until gpt_oss_experts() joins gate and up as HF interleaves them.
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm",
                "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
                "ffn_gate_exps": "mlp.experts.gate", "ffn_up_exps": "mlp.experts.up",
                "ffn_down_exps": "mlp.experts.down"},
}
# HF names that carry no ".weight" / ".bias" suffix.
BARE_NAMES = (".self_attn.sinks.weight", ".e_score_correction_bias.bias")
# Gemma 3's RMSNorm scales by (1 + weight); llama.cpp stores weight + 1.
GEMMA_NORM_SHIFT = 1.0
_SLIDING_THETA = 10000.0
_GEMMA3_PATTERN, _GPT_OSS_PATTERN = 6, 2


def stacks_experts(arch: str) -> bool:
    """Whether an architecture keeps its experts stacked in HF (not one tensor each)."""
    return arch == "gpt-oss"


def _layer_types(meta: dict[str, Any], arch: str, num_layers: int, default_pattern: int
                 ) -> tuple[str, ...]:
    """Per layer "sliding" or "full", as llama.cpp's set_swa_pattern(n) places them: every
    n-th layer full (n = 0: none), or one flag per layer."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelFileError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} "
                                 f"entries for {num_layers} layers")
        return tuple("sliding" if flag else "full" for flag in pattern)
    n = int(pattern)
    return tuple("sliding" if n == 0 or i % n < n - 1 else "full" for i in range(num_layers))


def _windows(meta: dict[str, Any], arch: str, num_layers: int, default_pattern: int
             ) -> dict[str, Any]:
    window = meta.get(f"{arch}.attention.sliding_window")
    if not window:
        return {}
    types = _layer_types(meta, arch, num_layers, default_pattern)
    if "sliding" not in types:
        return {"layer_types": types}
    return {"sliding_window": int(window), "layer_types": types}


def gemma3_fields(meta: dict[str, Any], num_layers: int, hidden: int, num_heads: int,
                  head_dim: int) -> dict[str, Any]:
    arch = "gemma3"
    scale = meta.get(f"{arch}.attention.scale")
    if scale is None:
        # llama.cpp's rule: Gemma 3 27B (62 layers) divides by hidden / heads, as its
        # query_pre_attn_scalar does; the other sizes by the head width.
        scale = (hidden // num_heads if num_layers == 62 else head_dim) ** -0.5
    fields = {"gemma_norms": True, "hidden_act": "gelu_tanh", "scale_embeddings": True,
              "qk_norm": True, "attention_scale": float(scale),
              **_windows(meta, arch, num_layers, _GEMMA3_PATTERN)}
    if fields.get("sliding_window"):
        fields["sliding_rope_theta"] = float(meta.get(f"{arch}.rope.freq_base_swa",
                                                      _SLIDING_THETA))
    return fields


def gpt_oss_fields(meta: dict[str, Any], num_layers: int) -> dict[str, Any]:
    arch = "gpt-oss"
    try:
        experts = {"num_experts": int(meta[f"{arch}.expert_count"]),
                   "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
                   "moe_intermediate_size": int(meta[f"{arch}.expert_feed_forward_length"])}
    except KeyError as exc:
        raise ModelFileError(f"GGUF metadata lacks {exc.args[0]!r}") from exc
    # HF's config names the experts' width intermediate_size.
    width = int(meta.get(f"{arch}.feed_forward_length", experts["moe_intermediate_size"]))
    return {**experts, "intermediate_size": width, "o_proj_bias": True,
            "attention_sinks": True, "expert_style": "gpt_oss",
            # llama.cpp's gpt-oss SwiGLU: fixed, as in the model's own code.
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
            **_windows(meta, arch, num_layers, _GPT_OSS_PATTERN)}


def gpt_oss_rope(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """gpt-oss's YaRN does not round its correction range (truncate: false in its config)."""
    if scaling is not None and scaling.get("rope_type") == "yarn":
        return {**scaling, "truncate": False}
    return scaling


def gpt_oss_experts(weights: dict[str, torch.Tensor], num_layers: int) -> None:
    """Stacked gate / up / down experts ([experts, out, in] and [experts, out] biases) as HF's
    gpt-oss keeps them, in place: gate_up_proj [experts, hidden, 2 * width] with gate and up
    interleaved (even columns gate), down_proj [experts, width, hidden]."""
    for layer in range(num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        parts = [p + f"{proj}.{kind}" for proj in ("gate", "up", "down")
                 for kind in ("weight", "bias")]
        missing = [name for name in parts if name not in weights]
        if missing:
            raise ModelFileError(f"layer {layer} lacks its experts' {', '.join(missing)}")
        gate, up = weights.pop(p + "gate.weight"), weights.pop(p + "up.weight")
        weights[p + "gate_up_proj"] = torch.stack(
            [gate.transpose(1, 2), up.transpose(1, 2)], dim=-1).flatten(-2).contiguous()
        weights[p + "down_proj"] = weights.pop(p + "down.weight").transpose(1, 2).contiguous()
        gate_bias, up_bias = weights.pop(p + "gate.bias"), weights.pop(p + "up.bias")
        weights[p + "gate_up_proj_bias"] = torch.stack([gate_bias, up_bias], -1).flatten(-2)
        weights[p + "down_proj_bias"] = weights.pop(p + "down.bias")
