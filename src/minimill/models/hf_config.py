"""An HF config.json as a ModelConfig, for every architecture the engine runs.

What a config asks for that the engine cannot do (logit soft-capping, bidirectional attention,
an activation it has no kernel for) is an error naming the field, never silently dropped.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from minimill.models.types import ModelConfig, ModelFileError

# HF `architectures` names -> ModelConfig.architecture.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    # DeepSeek-V3 and the checkpoints that share its architecture (Kimi K2).
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Defaults of the corresponding transformers config classes, for keys a config.json omits.
_MAX_POSITIONS_DEFAULT = {"llama": 2048, "qwen2": 32768, "qwen3": 40960, "qwen3_moe": 40960,
                          "gemma3": 131072, "gpt_oss": 131072, "deepseek_v3": 4096}
_ROPE_THETA_DEFAULT = {"gemma3": 1_000_000.0}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def architecture_of(cfg: dict[str, Any], path: Path) -> str:
    names = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[n] for n in names if n in HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelFileError(f"{path}: architectures {names} not supported "
                             f"(supported: {', '.join(HF_ARCHITECTURES)})")
    return arch


def _scaling(params: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling part of an HF rope dict (None for plain RoPE)."""
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if not scaling:
        return None
    # Older configs say "type"; keep the dict as given but make "rope_type" always present.
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    return None if scaling["rope_type"] == "default" and len(scaling) == 1 else scaling


def _rope(cfg: dict[str, Any], arch: str, path: Path
          ) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, the sliding layers' own rope_theta or None)."""
    params = cfg.get("rope_parameters")
    default_theta = _ROPE_THETA_DEFAULT.get(arch, 10000.0)
    if isinstance(params, dict) and "full_attention" in params:
        # transformers >= 5 writes one rope dict per layer type (Gemma 3).
        full, sliding = dict(params["full_attention"]), dict(params.get("sliding_attention", {}))
        if _scaling(sliding) is not None:
            raise ModelFileError(f"{path}: rope scaling on sliding layers is not supported")
        return (float(full.get("rope_theta", default_theta)), _scaling(full),
                float(sliding.get("rope_theta", 10000.0)))
    if isinstance(params, dict):
        # transformers >= 5 writes rope_theta and the scaling into one `rope_parameters` dict.
        theta = cfg.get("rope_theta") or params.get("rope_theta") or default_theta
        scaling = _scaling(params)
    else:
        theta = cfg.get("rope_theta") or default_theta
        scaling = _scaling(dict(cfg.get("rope_scaling") or {}))
    sliding_theta = (float(cfg.get("rope_local_base_freq", 10000.0)) if arch == "gemma3"
                     else None)
    return float(theta), scaling, sliding_theta


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int, path: Path
                 ) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, per-layer "sliding"/"full"), or (None, ()) for all-global models."""
    window = cfg.get("sliding_window")
    if arch in ("gemma3", "gpt_oss"):
        if cfg.get("use_bidirectional_attention"):
            raise ModelFileError(f"{path}: use_bidirectional_attention is not supported")
        names = cfg.get("layer_types")
        if names is None:
            pattern = int(cfg.get("sliding_window_pattern")
                          or cfg.get("_sliding_window_pattern")
                          or (6 if arch == "gemma3" else 2))
            names = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(num_layers)]
        try:
            types = tuple(_LAYER_TYPES[n] for n in names)
        except KeyError as exc:
            raise ModelFileError(f"{path}: unknown layer type {exc}") from exc
        if len(types) != num_layers:
            raise ModelFileError(f"{path}: layer_types has {len(types)} entries for "
                                 f"{num_layers} layers")
        if "sliding" not in types:
            return None, types
        if window is None:
            raise ModelFileError(f"{path}: sliding layers without a sliding_window")
        return int(window), types
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        if cfg.get("use_sliding_window"):
            raise ModelFileError(f"{path}: use_sliding_window is not supported for {arch}")
        return None, ()
    if window and cfg.get("model_type") == "mistral":  # Mistral 7B v0.1: every layer slides
        return int(window), ("sliding",) * num_layers
    return None, ()


def _deepseek_v3(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """MLA and the experts of DeepSeek-V3 (Kimi K2): the first first_k_dense_replace layers
    keep a dense MLP."""
    q_lora = cfg.get("q_lora_rank")
    num_experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if num_experts % n_group or not 0 < topk_group <= n_group:
        raise ValueError(f"{num_experts} experts in n_group {n_group} with topk_group "
                         f"{topk_group}")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"topk_method {cfg['topk_method']!r} (only noaux_tc is supported)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func {cfg['scoring_func']!r} (only sigmoid is supported)")
    first_dense = int(cfg.get("first_k_dense_replace") or 0) if num_experts else num_layers
    return {"kv_lora_rank": int(cfg["kv_lora_rank"]),
            "q_lora_rank": None if q_lora is None else int(q_lora),
            "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]),
            "qk_rope_head_dim": int(cfg["qk_rope_head_dim"]),
            "v_head_dim": int(cfg["v_head_dim"]),
            "rope_interleave": bool(cfg.get("rope_interleave", True)),
            "o_proj_bias": bool(cfg.get("attention_bias", False)),
            "head_dim": int(cfg["qk_rope_head_dim"]),
            "num_experts": num_experts,
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "dense_layers": tuple(range(min(first_dense, num_layers))),
            "expert_style": "deepseek_v3",
            "n_shared_experts": int(cfg.get("n_shared_experts") or 0),
            "n_group": n_group, "topk_group": topk_group,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0))}


def mla_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """MLA's softmax scale: qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim)
    squared where the rope is scaled (DeepSeek's reference, and HF's yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    s = rope_scaling or {}
    mscale_all_dim = s.get("mscale_all_dim") or 0
    if s.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = float(s["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _moe(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    if arch == "deepseek_v3":
        return _deepseek_v3(cfg, num_layers)
    if arch == "gpt_oss":  # every layer routes; experts are intermediate_size wide
        return {"num_experts": int(cfg["num_local_experts"]),
                "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
                "moe_intermediate_size": int(cfg["intermediate_size"]),
                "o_proj_bias": True, "attention_sinks": True, "expert_style": "gpt_oss",
                "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
                "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}
    if arch != "qwen3_moe":
        return {}
    step = int(cfg.get("decoder_sparse_step", 1))
    only_dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
    num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
    dense = tuple(i for i in range(num_layers)
                  if i in only_dense or not (num_experts > 0 and (i + 1) % step == 0))
    return {"num_experts": num_experts,
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "dense_layers": dense}


def _check_unsupported(cfg: dict[str, Any], arch: str, path: Path) -> str:
    """The activation's engine name; errors for fields the engine cannot honour."""
    act_name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act_name not in _ACTIVATIONS:
        raise ModelFileError(f"{path}: activation {act_name!r} is not supported "
                             f"(supported: {', '.join(_ACTIVATIONS)})")
    if cfg.get("mlp_bias", False):
        raise ModelFileError(f"{path}: MLPs with bias are not supported")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(field) is not None:
            raise ModelFileError(f"{path}: {field} is not supported")
    quantization = cfg.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        # gpt-oss's MXFP4 experts are dequantized at load; no other scheme is read.
        if not (arch == "gpt_oss" and method == "mxfp4"):
            raise ModelFileError(f"{path}: quantization {method!r} is not supported for "
                                 f"{arch} (an unquantized checkpoint or GGUF is)")
    return _ACTIVATIONS[act_name]


def config_from_hf(cfg: dict[str, Any], path: Path, eos_token_ids: tuple[int, ...] = (),
                   bos_token_id: int | None = None) -> ModelConfig:
    """ModelConfig from an HF config.json dict (`path` names it in errors)."""
    arch = architecture_of(cfg, path)
    try:
        hidden_act = _check_unsupported(cfg, arch, path)
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        rope_theta, rope_scaling, sliding_theta = _rope(cfg, arch, path)
        window, layer_types = _layer_types(cfg, arch, num_layers, path)
        gemma = arch == "gemma3"
        fields = {"head_dim": int(cfg.get("head_dim") or hidden // num_heads),
                  "attention_scale": (float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
                                      if gemma else None),
                  **_moe(cfg, arch, num_layers)}
        if arch == "deepseek_v3":
            fields["attention_scale"] = mla_scale(
                fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"], rope_scaling)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings")
                                        or _MAX_POSITIONS_DEFAULT[arch]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
            gemma_norms=gemma,
            hidden_act=hidden_act,
            scale_embeddings=gemma,
            sliding_window=window,
            layer_types=layer_types,
            sliding_rope_theta=sliding_theta if window else None,
            **fields,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{path}: config.json is missing or has a bad value: {exc}") from exc
