"""Loading a GGUF file (llama, qwen2, qwen3, qwen3moe, gemma3, gpt-oss, deepseek2 architectures)
into a LoadedModel in HF naming and layout.

llama.cpp's converter permutes the rows of Q and K for llama models so that rotary embedding
pairs adjacent dimensions; HF pairs dimension i with i + head_dim/2 (rotate_half). The
permutation is undone here, so the engine and HF transformers see the same weights. Qwen's
converters keep HF's order. A mixture of experts stores each layer's experts stacked in one
tensor per projection (`blk.N.ffn_gate_exps`, [experts, out, in]); they are split into HF's
per-expert names, and a layer without a router (`ffn_gate_inp`) is dense. The config comes
from gguf_config.py; what Gemma 3 and gpt-oss add lives in gguf_families.py, DeepSeek's MLA and
routing in gguf_deepseek2.py.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import torch

from minimill.models import gguf_deepseek2 as deepseek2
from minimill.models import gguf_families as families
from minimill.models.dequant import dequantize
from minimill.models.gguf_config import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from minimill.models.gguf_config import config_from_gguf
from minimill.models.gguf_file import read_gguf_header, read_tensor_bytes
from minimill.models.gguf_tokenizer import tokenizer_from_gguf
from minimill.models.shape_check import check_shapes
from minimill.models.types import LoadedModel, ModelFileError

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
