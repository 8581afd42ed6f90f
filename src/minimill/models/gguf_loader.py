"""Loading a GGUF file (llama, qwen2, qwen3, qwen3moe, gemma3, gpt-oss, deepseek2 architectures)
into a LoadedModel in HF naming and layout.

llama.cpp's converter permutes the rows of Q and K for llama models so that rotary embedding
pairs adjacent dimensions; HF pairs dimension i with i + head_dim/2 (rotate_half). The
permutation is undone here, so the engine and HF transformers see the same weights. Qwen's
converters keep HF's order. A mixture of experts stores each layer's experts stacked in one
tensor per projection (`blk.N.ffn_gate_exps`, [experts, out, in]); they are split into HF's
per-expert names, and a layer without a router (`ffn_gate_inp`) is dense. What Gemma 3 and
gpt-oss add lives in gguf_families.py, DeepSeek's MLA and routing in gguf_deepseek2.py.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import torch

from minimill.models import gguf_deepseek2 as deepseek2
from minimill.models import gguf_families as families
from minimill.models.dequant import dequantize
from minimill.models.gguf_file import GGUFHeader, read_gguf_header, read_tensor_bytes
from minimill.models.gguf_tokenizer import tokenizer_from_gguf
from minimill.models.shape_check import check_shapes
from minimill.models.tokenizer import END_OF_TURN_TOKENS, Tokenizer
from minimill.models.types import LoadedModel, ModelConfig, ModelFileError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "gpt-oss",
                           "deepseek2")
# GGUF's architecture names that the engine spells otherwise (ModelConfig.architecture).
_ENGINE_ARCHITECTURE = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                        "deepseek2": "deepseek_v3"}
PROGRESS_EVERY_S = 2.0
log = logging.getLogger("minimill.models")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
# Stacked experts: one tensor per layer and projection, split into HF's per-expert names.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_FAMILY_NAMES = {**families.LAYER_NAMES, deepseek2.ARCH: deepseek2.LAYER_NAMES}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name of a GGUF tensor of `arch`, or None if the tensor has no HF
    counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _LAYER_NAMES | _FAMILY_NAMES.get(arch, {})
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    hf_name = f"model.layers.{layer}.{names[part]}.{kind}"
    return hf_name.rsplit(".", 1)[0] if hf_name.endswith(families.BARE_NAMES) else hf_name


def hf_expert_names(gguf_name: str, num_experts: int, arch: str = "llama") -> list[str] | None:
    """HF names of each expert's slice of a stacked expert tensor (None: not one, or `arch`
    keeps its experts stacked)."""
    if families.stacks_experts(arch):
        return None
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _EXPERT_NAMES or match.group(3) != "weight":
        return None
    layer, part = match.group(1), _EXPERT_NAMES[match.group(2)]
    return [f"model.layers.{layer}.mlp.experts.{e}.{part}.weight" for e in range(num_experts)]


def _layer_of(gguf_name: str) -> int:
    """The block a tensor belongs to (-1: a global tensor)."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    return -1 if match is None else int(match.group(1))


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute` of Q/K rows (works for weights [out, in] and biases)."""
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    # llama.cpp stored row (h, j, r) of [heads, head_dim/2, 2] where HF has (h, r, j).
    return (weight.reshape(num_heads, head_dim // 2, 2, *rest)
            .transpose(1, 2).reshape(weight.shape).contiguous())


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


class Progress:
    """A long step said as it goes: once at its start, then every PROGRESS_EVERY_S seconds
    (how far it is), then at its end; a first start is not minutes of silence."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.count = what, total, 0
        self.started = self.last = time.monotonic()
        log.info("%s", what)

    def step(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            log.info("%s: %d of %d tensors (%.0f%%, %.0fs)", self.what, self.count, self.total,
                     100 * self.count / max(self.total, 1), now - self.started)

    def done(self) -> None:
        log.info("%s: done in %.1fs", self.what, time.monotonic() - self.started)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.bfloat16,
              name: str | None = None) -> LoadedModel:
    """Read, dequantize and (for llama) un-permute every tensor of a GGUF file."""
    path = Path(path)
    header = read_gguf_header(path)
    tokenizer = tokenizer_from_gguf(header.metadata, path)
    config = config_from_gguf(header, tokenizer)
    arch = str(header.metadata["general.architecture"])
    if "rope_freqs.weight" in header.tensors:
        # Llama 3.1-style frequency factors: not expressible as our rope_scaling yet.
        raise ModelFileError(f"{path}: rope_freqs (llama3 rope scaling) is not supported yet")
    weights: dict[str, torch.Tensor] = {}
    progress = Progress(f"dequantizing {path.name} to {str(dtype).removeprefix('torch.')}",
                        len(header.tensors))
    with path.open("rb") as f:
        for info in header.tensors.values():
            progress.step()
            if _layer_of(info.name) >= config.num_hidden_layers:
                continue  # a multi-token prediction layer, which the engine does not run
            hf_name = hf_tensor_name(info.name, arch)
            expert_names = hf_expert_names(info.name, config.num_experts, arch)
            if hf_name is None and expert_names is None:
                raise ModelFileError(f"{path}: unexpected tensor {info.name!r}")
            if "_exps." in info.name and info.shape[:1] != (config.num_experts,):
                raise ModelFileError(f"{path}: tensor {info.name!r} has shape {info.shape}, "
                                     f"metadata implies {config.num_experts} experts")
            shifted = config.gemma_norms and info.name.endswith("norm.weight")
            # A shifted norm is un-shifted in float32: in bfloat16, 1 + w keeps too few of
            # w's bits. DeepSeek's router stays float32, as the HF loader keeps it.
            keep32 = shifted or (config.expert_style == "deepseek_v3" and hf_name is not None
                                 and hf_name.endswith(deepseek2.FLOAT32_SUFFIXES))
            tensor = dequantize(read_tensor_bytes(f, info, path), info.ggml_type, info.shape,
                                torch.float32 if keep32 else dtype)
            if shifted:
                tensor = (tensor - families.GEMMA_NORM_SHIFT).to(dtype)
            if expert_names is not None:
                # Each its own storage: the warm cache's safetensors refuse shared ones.
                weights.update(zip(expert_names, (t.clone() for t in tensor.unbind(0)),
                                   strict=True))
                continue
            assert hf_name is not None
            if config.architecture == "llama" and ".attn_q." in info.name:
                tensor = unpermute_rope_rows(tensor, config.num_attention_heads)
            elif config.architecture == "llama" and ".attn_k." in info.name:
                tensor = unpermute_rope_rows(tensor, config.num_key_value_heads)
            weights[hf_name] = tensor
    progress.done()
    try:
        if arch == "gpt-oss":
            families.gpt_oss_experts(weights, config.num_hidden_layers)
        elif arch == deepseek2.ARCH:
            deepseek2.join_kv_b(weights, config)
    except ModelFileError as exc:
        raise ModelFileError(f"{path}: {exc}") from exc
    check_shapes(path, config, weights)
    meta = header.metadata
    return LoadedModel(
        name=name or path.stem, config=config, weights=weights, tokenizer=tokenizer,
        chat_template=tokenizer.chat_template, source_path=str(path),
        extra={"format": "gguf", "general.name": meta.get("general.name"),
               "ggml_types": sorted({i.ggml_type.name for i in header.tensors.values()})},
    )
