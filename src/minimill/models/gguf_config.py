"""A GGUF file's `{arch}.*` metadata as a ModelConfig, for every architecture the GGUF loader
reads; what Gemma 3 and gpt-oss add comes from gguf_families.py, DeepSeek's from
gguf_deepseek2.py. A key the file lacks and the engine needs is an error naming the key.
"""

from __future__ import annotations

from typing import Any

from minimill.models import gguf_deepseek2 as deepseek2
from minimill.models import gguf_families as families
from minimill.models.gguf_file import GGUFHeader
from minimill.models.tokenizer import END_OF_TURN_TOKENS, Tokenizer
from minimill.models.types import ModelConfig, ModelFileError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "gpt-oss",
                           "deepseek2")
# GGUF's architecture names that the engine spells otherwise (ModelConfig.architecture).
_ENGINE_ARCHITECTURE = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                        "deepseek2": "deepseek_v3"}


def _meta(header: GGUFHeader, key: str, default: Any = None) -> Any:
    value = header.metadata.get(key, default)
    if value is None:
        raise ModelFileError(f"{header.path}: GGUF metadata lacks {key!r}")
    return value


def _rope_scaling(header: GGUFHeader, arch: str) -> dict[str, Any] | None:
    meta = header.metadata
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind is None and meta.get(f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": float(factor or 1.0)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                             ("attn_factor", "attention_factor")):
        value = meta.get(f"{arch}.rope.scaling.{gguf_key}")
        if value is not None:
            scaling[hf_key] = float(value)
    if kind == "yarn":  # llama.cpp's YaRN defaults, where the file says none
        scaling.setdefault("beta_fast", 32.0)
        scaling.setdefault("beta_slow", 1.0)
    return scaling


def config_from_gguf(header: GGUFHeader, tokenizer: Tokenizer) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; the vocabulary size from the tokenizer tokens."""
    arch = str(_meta(header, "general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{header.path}: architecture {arch!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    hidden = int(_meta(header, f"{arch}.embedding_length"))
    num_heads = int(_meta(header, f"{arch}.attention.head_count"))
    head_dim = int(header.metadata.get(f"{arch}.attention.key_length", hidden // num_heads))
    vocab = len(header.metadata.get("tokenizer.ggml.tokens") or ())
    num_layers = (deepseek2.num_decoder_layers(header.metadata) if arch == deepseek2.ARCH
                  else int(_meta(header, f"{arch}.block_count")))
    eos_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    family = _experts(header, arch, num_layers)
    rope_scaling = _rope_scaling(header, arch)
    try:
        if arch == "gemma3":
            family = families.gemma3_fields(header.metadata, num_layers, hidden, num_heads,
                                             head_dim)
        elif arch == "gpt-oss":
            family = families.gpt_oss_fields(header.metadata, num_layers)
            rope_scaling = families.gpt_oss_rope(rope_scaling)
        elif arch == deepseek2.ARCH:
            rope_scaling = deepseek2.deepseek2_rope(header.metadata, rope_scaling)
            family = deepseek2.deepseek2_fields(header.metadata, num_heads, num_layers,
                                                rope_scaling)
            family["o_proj_bias"] = "blk.0.attn_output.bias" in header.tensors
    except ModelFileError as exc:
        raise ModelFileError(f"{header.path}: {exc}") from exc
    fields: dict[str, Any] = dict(
        architecture=_ENGINE_ARCHITECTURE.get(arch, arch),
        vocab_size=vocab,
        hidden_size=hidden,
        # A mixture of experts may declare no dense width (no dense layer needs one).
        intermediate_size=int(header.metadata.get(f"{arch}.feed_forward_length", 0)
                              if "num_experts" in family
                              else _meta(header, f"{arch}.feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(header.metadata.get(f"{arch}.attention.head_count_kv",
                                                    num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_meta(header, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(header.metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_meta(header, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias="blk.0.attn_q.bias" in header.tensors,
        rope_scaling=rope_scaling,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(eos_ids),
        qk_norm="blk.0.attn_q_norm.weight" in header.tensors,
    )
    return ModelConfig(**(fields | family))


def _experts(header: GGUFHeader, arch: str, num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts (none for a dense model). llama.cpp
    normalises a Qwen3-MoE token's top-k weights unless the file says otherwise."""
    if arch != "qwen3moe":
        return {}
    return {"num_experts": int(_meta(header, f"{arch}.expert_count")),
            "num_experts_per_tok": int(_meta(header, f"{arch}.expert_used_count")),
            "moe_intermediate_size": int(_meta(header, f"{arch}.expert_feed_forward_length")),
            "norm_topk_prob": bool(header.metadata.get(f"{arch}.expert_weights_norm", True)),
            "dense_layers": tuple(i for i in range(num_layers)
                                  if f"blk.{i}.ffn_gate_inp.weight" not in header.tensors)}
