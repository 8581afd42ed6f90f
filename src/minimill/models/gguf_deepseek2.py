"""What a GGUF file of DeepSeek-V3 (llama.cpp's `deepseek2`) says beyond the Llama layer: MLA's
ranks and head widths, grouped sigmoid routing with its correction bias (`exp_probs_b`), shared
experts, leading dense layers; and its MLA tensors back in HF's names.

llama.cpp writes MLA as multi-query attention over the latent: `attention.key_length` is
kv_lora_rank + the rotary width, and the per-head widths are `key_length_mla` /
`value_length_mla`. Newer converters split HF's kv_b_proj into `attn_k_b` (transposed,
[heads, rank, nope]) and `attn_v_b` ([heads, v, rank]); older ones keep `attn_kv_b`. Either is
joined back into kv_b_proj. DeepSeek-V2's softmax routing (a file without
`expert_gating_func`, as llama.cpp reads it) is refused: the engine routes DeepSeek by sigmoid.
"""

from __future__ import annotations

from typing import Any

import torch

from minimill.models.hf_config import mla_scale
from minimill.models.types import ModelFileError

ARCH = "deepseek2"
LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    # Joined into kv_b_proj by join_kv_b().
    "attn_k_b": "self_attn.k_b", "attn_v_b": "self_attn.v_b",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# The router stays float32 whatever the model's dtype, as the HF loader keeps it.
FLOAT32_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
# llama.cpp stores 0.1 * mscale_all_dim as the YaRN log multiplier and takes mscale as 1.
_LOG_MUL_PER_MSCALE = 0.1


def _get(meta: dict[str, Any], key: str) -> Any:
    value = meta.get(f"{ARCH}.{key}")
    if value is None:
        raise ModelFileError(f"GGUF metadata lacks {ARCH}.{key!r}")
    return value


def num_decoder_layers(meta: dict[str, Any]) -> int:
    """Blocks the decoder runs: block_count less the multi-token prediction layers some files
    carry after them (the engine does not run those)."""
    return int(_get(meta, "block_count")) - int(meta.get(f"{ARCH}.nextn_predict_layers", 0))


def deepseek2_rope(meta: dict[str, Any], scaling: dict[str, Any] | None
                   ) -> dict[str, Any] | None:
    """DeepSeek's YaRN: mscale and mscale_all_dim from the file's log multiplier."""
    log_mul = meta.get(f"{ARCH}.rope.scaling.yarn_log_multiplier")
    if scaling is None or scaling.get("rope_type") != "yarn" or log_mul is None:
        return scaling
    return {**scaling, "mscale": 1.0,
            "mscale_all_dim": round(float(log_mul) / _LOG_MUL_PER_MSCALE, 6)}


def deepseek2_fields(meta: dict[str, Any], num_heads: int, num_layers: int,
                     rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    gating = int(meta.get(f"{ARCH}.expert_gating_func", 1))  # llama.cpp: absent is softmax
    if gating != _SIGMOID:
        raise ModelFileError(f"{ARCH}.expert_gating_func {_GATING.get(gating, gating)!r} is "
                             "not supported (only sigmoid, DeepSeek-V3's)")
    rope_dim = int(_get(meta, "rope.dimension_count"))
    qk_head = int(meta.get(f"{ARCH}.attention.key_length_mla")
                  or _get(meta, "attention.key_length"))
    v_head = int(meta.get(f"{ARCH}.attention.value_length_mla")
                 or _get(meta, "attention.value_length"))
    q_lora = meta.get(f"{ARCH}.attention.q_lora_rank")
    num_experts = int(meta.get(f"{ARCH}.expert_count", 0))
    n_group = int(meta.get(f"{ARCH}.expert_group_count", 1))
    first_dense = int(meta.get(f"{ARCH}.leading_dense_block_count", 0))
    return {
        "kv_lora_rank": int(_get(meta, "attention.kv_lora_rank")),
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "qk_nope_head_dim": qk_head - rope_dim, "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_head, "head_dim": rope_dim, "rope_interleave": True,
        # MLA's heads each read the latent: HF counts as many key/value heads as query heads.
        "num_key_value_heads": num_heads,
        "intermediate_size": int(meta.get(f"{ARCH}.feed_forward_length", 0)),
        "num_experts": num_experts,
        "num_experts_per_tok": int(meta.get(f"{ARCH}.expert_used_count", 0)),
        "moe_intermediate_size": int(meta.get(f"{ARCH}.expert_feed_forward_length", 0)),
        "norm_topk_prob": bool(meta.get(f"{ARCH}.expert_weights_norm", False)),
        "dense_layers": tuple(range(min(first_dense if num_experts else num_layers,
                                        num_layers))),
        "expert_style": "deepseek_v3",
        "n_shared_experts": int(meta.get(f"{ARCH}.expert_shared_count", 0)),
        "n_group": n_group,
        "topk_group": int(meta.get(f"{ARCH}.expert_group_used_count", n_group)),
        "routed_scaling_factor": float(meta.get(f"{ARCH}.expert_weights_scale", 1.0)),
        "attention_scale": mla_scale(qk_head, rope_scaling),
    }


def join_kv_b(weights: dict[str, torch.Tensor], config: Any) -> None:
    """k_b [heads, rank, nope] and v_b [heads, v, rank] back into HF's kv_b_proj
    [heads * (nope + v), rank], in place."""
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.self_attn."
        if p + "k_b.weight" not in weights and p + "v_b.weight" not in weights:
            continue
        if p + "k_b.weight" not in weights or p + "v_b.weight" not in weights:
            raise ModelFileError(f"layer {layer} has one of attn_k_b and attn_v_b, not both")
        k_b, v_b = weights.pop(p + "k_b.weight"), weights.pop(p + "v_b.weight")
        heads, rank = config.num_attention_heads, config.kv_lora_rank
        k_b = k_b.reshape(heads, rank, config.qk_nope_head_dim).transpose(1, 2)
        v_b = v_b.reshape(heads, config.v_head_dim, rank)
        joined = torch.cat([k_b, v_b], dim=1)  # [heads, nope + v, rank]
        weights[p + "kv_b_proj.weight"] = joined.reshape(-1, rank).contiguous()


