"""Loading a GGUF file (llama / qwen2 architectures) into a LoadedModel in HF naming and layout.

llama.cpp's converter permutes the rows of Q and K for llama models so that rotary embedding
pairs adjacent dimensions; HF pairs dimension i with i + head_dim/2 (rotate_half). The
permutation is undone here, so the engine and HF transformers see the same weights.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import torch

from minimill.models.dequant import dequantize
from minimill.models.gguf_file import GGUFHeader, read_gguf_header, read_tensor_bytes
from minimill.models.gguf_tokenizer import tokenizer_from_gguf
from minimill.models.shape_check import check_shapes
from minimill.models.tokenizer import END_OF_TURN_TOKENS, Tokenizer
from minimill.models.types import LoadedModel, ModelConfig, ModelFileError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
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
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None if the tensor has no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


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
    eos_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_meta(header, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_meta(header, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(header.metadata.get(f"{arch}.attention.head_count_kv",
                                                    num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_meta(header, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(header.metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_meta(header, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias="blk.0.attn_q.bias" in header.tensors,
        rope_scaling=_rope_scaling(header, arch),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(eos_ids),
    )


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
    if "rope_freqs.weight" in header.tensors:
        # Llama 3.1-style frequency factors: not expressible as our rope_scaling yet.
        raise ModelFileError(f"{path}: rope_freqs (llama3 rope scaling) is not supported yet")
    weights: dict[str, torch.Tensor] = {}
    progress = Progress(f"dequantizing {path.name} to {str(dtype).removeprefix('torch.')}",
                        len(header.tensors))
    with path.open("rb") as f:
        for info in header.tensors.values():
            progress.step()
            hf_name = hf_tensor_name(info.name)
            if hf_name is None:
                raise ModelFileError(f"{path}: unexpected tensor {info.name!r}")
            tensor = dequantize(read_tensor_bytes(f, info, path), info.ggml_type, info.shape,
                                dtype)
            if config.architecture == "llama" and ".attn_q." in info.name:
                tensor = unpermute_rope_rows(tensor, config.num_attention_heads)
            elif config.architecture == "llama" and ".attn_k." in info.name:
                tensor = unpermute_rope_rows(tensor, config.num_key_value_heads)
            weights[hf_name] = tensor
    progress.done()
    check_shapes(path, config, weights)
    meta = header.metadata
    return LoadedModel(
        name=name or path.stem, config=config, weights=weights, tokenizer=tokenizer,
        chat_template=tokenizer.chat_template, source_path=str(path),
        extra={"format": "gguf", "general.name": meta.get("general.name"),
               "ggml_types": sorted({i.ggml_type.name for i in header.tensors.values()})},
    )
